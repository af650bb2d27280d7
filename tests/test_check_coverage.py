"""Every registered check runs on grpolab's own code and passes, and every registered mutant
(tests/mutants/, `registry.mutants()`) fails the check named for it; the two counts are
printed (`pytest -rP tests/test_check_coverage.py`) and asserted.

grpolab's own code: every batch check under the seed's objective and under each declared
objective of test_checks.DECLARED (one full sweep each), the episode checks on probe episodes,
and the checks on the whole run in two preflights of the demo (the second samples with top-k
from bf16 copies and packs its micro-batches, for the engine and packing checks). A mutant:
its named check alone (the others read nothing of it), under the objective that declares the
option the bug is in, on the same inputs, where grpolab's own functions pass that check."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_checks import DECLARED, MENU_CAUGHT_BY, declared
from test_engine_checks import BF16, registry_check, scored_batch, sync_mutant
from test_packing import packing_exact

from grpolab.check import CheckResult
from grpolab.checks import registry
from grpolab.checks.context import Context
from grpolab.checks.rewards import check_reward_probes
from grpolab.checks.runner import run_check, run_checks, run_episode_checks
from grpolab.config import load_config
from grpolab.core import CoreFunctions
from grpolab.functions import core_functions, load_episode_impl, load_impl
from grpolab.model.policy import build_tiny_model
from grpolab.rewards import load_rewards
from grpolab.rewards.probes import probe_rows, run_probes
from grpolab.rollout.episodes import EpisodeFunctions
from grpolab.rollout.hf import HFEngine
from grpolab.tasks import load_task
from grpolab.train.preflight import preflight

MUTANTS = Path(__file__).parent / "mutants"
REGISTERED = registry.mutants()  # file -> (the check that must catch it, what it declares)
# grpolab's own code, each run once: the batch checks under every declared objective, the
# episode checks, one preflight of the demo (the checks on the whole run).
OBJECTIVES = {"seed": {}, **DECLARED}
OWN = (*OBJECTIVES, "episodes", "preflight", "preflight_engine_copy")
PREFLIGHT = ["rollout.max_completion_length=6", "batch.num_generations=4"]
# The engine checks that need a sampler option or an engine with weights of its own: top-k
# sampling, and the hf engine's bf16 copies that the weight sync must bring up to date.
ENGINE_COPY = [*PREFLIGHT, "rollout.top_k=12", "runtime.precision=bf16"]
# A token budget per micro-batch: packing.exact runs (the checks' batch as test_packing cuts it).
PACKED = ["batch.num_generations=4", "batch.prompts_per_step=4",
          "rollout.max_completion_length=8", "batch.max_tokens_per_microbatch=4096"]  # fmt: skip


class OwnCode:
    """The results of grpolab's own code under each of OWN, each run once when first read."""

    def __init__(self, model, batch, probe_batch):
        self.model, self.batch, self.probe_batch = model, batch, probe_batch
        self.cache: dict[str, list[CheckResult]] = {}

    def results(self, name: str) -> list[CheckResult]:
        if name not in self.cache:
            if name == "episodes":
                self.cache[name] = run_episode_checks(self.model, self.probe_batch)
            elif name == "preflight":
                self.cache[name] = preflight(load_config(None, PREFLIGHT))
            elif name == "preflight_engine_copy":
                overrides = [*ENGINE_COPY, "batch.max_tokens_per_microbatch=4096"]
                self.cache[name] = preflight(load_config(None, overrides))
            else:
                settings = declared(OBJECTIVES[name])
                self.cache[name] = run_checks(self.model, self.batch, settings)
        return self.cache[name]


@pytest.fixture(scope="module")
def own(model_and_batch, probe_batch):
    return OwnCode(*model_and_batch, probe_batch)


@pytest.mark.parametrize("name", OWN)
def test_grpolabs_own_code_passes_every_check(own, name):
    results = own.results(name)
    failed = [(r.id, r.measured, r.error) for r in results if not r.passed]
    assert results and not failed
    if name in OBJECTIVES:  # the checks of a declared option run where it is declared
        ids = {r.id for r in results}
        assert {c for c, o in MENU_CAUGHT_BY.values() if o == OBJECTIVES[name]} <= ids


def test_every_registered_check_is_exercised(own):
    exercised = {r.id for name in OWN for r in own.results(name)}
    print(f"checks exercised on grpolab's own code: {len(exercised)} of {len(registry.ALL)}")
    assert exercised == set(registry.BY_ID)


# --- The mutants ---------------------------------------------------------------------------


def reward_name(path: Path) -> str:
    """The one function a reward mutant's file defines."""
    lines = path.read_text().splitlines()
    (name,) = [line[4:].split("(")[0] for line in lines if line.startswith("def ")]
    return name


def reward_probe(path: Path | None, check_id: str) -> CheckResult:
    """The reward probe `check_id` on the demo's task (its bare "37+48=" prompts), of the
    file's function (None: grpolab's accuracy reward)."""
    refs = ["accuracy"] if path is None else [f"{path}:{reward_name(path)}"]
    report = run_probes(probe_rows(load_task()), load_rewards(refs, task="arithmetic"))
    return {r.id: r for r in check_reward_probes(report)}[check_id]


def named_check(mutant: str | None, check_id: str, declares: dict, inputs) -> list[CheckResult]:
    """The check `check_id` alone on the mutant file's functions (None: grpolab's own) under
    the objective that declares `declares`: one result, or none where its condition does
    not hold. The engine checks read a real engine: engine.sampling a batch it sampled as
    declared, engine.sync_coverage its bf16 copies (the mutant: its sync in the engine's)."""
    model, batch, probe_batch, tokenizer = inputs
    path = None if mutant is None else MUTANTS / f"{mutant}.py"
    check = registry.BY_ID[check_id]
    if check_id == "engine.sync_coverage":
        fresh = build_tiny_model(tokenizer, seed=1)  # the probe moves its weights
        engine = HFEngine(fresh, tokenizer, precision=BF16)
        scored_batch(engine, G=2)  # the engine's copies made by a rollout
        return [registry_check(engine if mutant is None else sync_mutant(engine, mutant), fresh)]
    if check_id == "engine.sampling":
        batch = scored_batch(HFEngine(model, tokenizer), **sampling_of(declares))
    if check.stage == "episodes":
        fns = EpisodeFunctions() if path is None else load_episode_impl(path)
        return run_episode_checks(model, probe_batch, fns=fns, only={check_id})
    if check_id.startswith("rewards."):
        return [reward_probe(path, check_id)]
    impl = CoreFunctions() if path is None else load_impl(path)
    if check_id == "packing.exact":  # the trainer packs on the fused path
        impl = core_functions("fused") if path is None else impl
        return [packing_exact(impl, model, batch, load_config(None, PACKED))]
    if check.stage == "batch":
        return run_checks(model, batch, declared(declares), impl=impl, only={check_id})
    return [run_check(check, Context(impl, declared(declares), model, batch))]


def sampling_of(declares: dict) -> dict:
    """The sampler's options among an objective's declared keys."""
    return {k: v for k, v in declares.items() if k in ("temperature", "top_k", "top_p")}


@pytest.fixture(scope="module")
def caught(model_and_batch, probe_batch, tiny):
    """mutant -> (its named check's result on the mutant, on grpolab's own functions), each
    computed once when first read."""
    inputs, cache = (*model_and_batch, probe_batch, tiny[1]), {}

    def of(mutant: str) -> tuple[CheckResult, CheckResult]:
        if mutant not in cache:
            check, declares = REGISTERED[mutant]
            (theirs,) = named_check(mutant, check.id, declares, inputs)
            (ours,) = named_check(None, check.id, declares, inputs)
            cache[mutant] = theirs, ours
        return cache[mutant]

    return of


@pytest.mark.parametrize("mutant", sorted(REGISTERED))
def test_each_mutant_fails_its_named_check(caught, mutant, model_and_batch):
    theirs, ours = caught(mutant)
    check, declares = REGISTERED[mutant]
    assert theirs.id == check.id and not theirs.passed, theirs
    assert theirs.hint  # a failure names the likely bug
    assert ours.passed, ours  # the check tells the bug from grpolab's own functions
    path = MUTANTS / f"{mutant}.py"
    if check.id.startswith("rewards."):
        assert f"reward {reward_name(path)!r}" in theirs.what  # the probe names the function
    if check.stage == "episodes":
        fns = load_episode_impl(path)
        assert set(fns.source) and fns.source != EpisodeFunctions().source
    if check.stage == "batch" and declares and check.id != "loss.metrics":
        # The same file passes that check where the option it gets wrong is not declared.
        model, batch = model_and_batch
        impl = load_impl(path)
        plain = run_checks(model, batch, impl=impl, only={check.id})
        assert not plain or plain[0].passed, plain


def test_every_registered_mutant_is_caught(caught):
    files = {p.stem for p in MUTANTS.glob("*.py")}
    assert files == set(REGISTERED)  # every mutant file is declared by its check
    missed = [m for m in sorted(REGISTERED) if caught(m)[0].passed]
    print(f"mutants caught by their named check: {len(REGISTERED) - len(missed)} of {len(files)}")
    assert not missed
