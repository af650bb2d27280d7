"""GRPOConfig: TRL's names (grpolab.config.trl: what each means here) and grpolab's dotted
keys as keyword arguments, turned into load_config's values."""

from __future__ import annotations

from typing import Any

from grpolab.config import Config, check_values, get
from grpolab.config.resume import default_config
from grpolab.config.trl import TRL_KEYS, trl_values


class GRPOConfig:
    """TRL's GRPOConfig: TRL's field names and any grpolab key by its dotted name
    (`GRPOConfig(**{"task.answer_kind": "string"})`). A name that is neither, or a value
    grpolab cannot honour, is refused where it is written, named, with the likeliest name
    meant. Attributes read back as TRL's (`args.output_dir`): the value given, else what the
    run resolved (once a trainer holds it), else grpolab's default."""

    def __init__(self, **given: Any):
        self.given = given
        # values: grpolab's keys; data: the names resolved with the rows (epochs, ...)
        self.values, self.data, self.warnings = trl_values(given)
        check_values(self.values)  # the checks between keys wait for the whole config
        self.resolved: Config | None = None  # the run's config, once a trainer built it

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("given", "values", "data", "warnings", "resolved"):
            raise AttributeError(name)
        if name in self.given:
            return self.given[name]
        if name in TRL_KEYS:
            return get(self.resolved or default_config(), TRL_KEYS[name])
        if name == "num_train_epochs":  # TRL's default, what the trainer applies
            return 3
        raise AttributeError(f"GRPOConfig has no {name!r} (not given, and not a TRL name grpolab "
                             "maps to one key)")  # fmt: skip

    def __repr__(self) -> str:
        return f"GRPOConfig({', '.join(f'{k}={v!r}' for k, v in self.given.items())})"
