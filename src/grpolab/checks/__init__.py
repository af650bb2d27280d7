"""The preflight's checks, as a registry: every intermediate quantity of GRPO measured before
training may start.

    context.py      Context: what a check reads (the functions under test, the declared
                    objective, the model and batch) and the cases and helpers checks share
    reference.py    the float64 references: log-probs, advantages, the policy term, KL
    logprobs.py advantages.py ratio.py clip.py kl.py normalisation.py loss.py
                    the seed's seven goals, one module each (the options' checks live in
                    their units, grpolab.objective.*)
    rewards.py      rewards.variance and the reward probes
    registry.py     every check in run order; the ids, hints and blame read from it
    runner.py       run_checks (model + batch), run_stage, blamed, goal_status
    tolerance.py    agreement with float64: the checked path against a plain one
    episodes.py     the checks of multi-turn episodes
    preflight.py    the checks that need the whole run, the preflight and its gate

This module imports nothing, so that the units of the objective can declare checks
(`grpolab.check`) below the layers that run them.
"""
