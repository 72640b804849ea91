"""First-party reward plugins (registered through molt-sdk's own ``molt`` entry point).

Every reward is ``reward(response, task, **options) -> float`` with an ``Options`` Pydantic
model (see :mod:`molt_plugins.rewards.base`); raising :class:`molt_core.types.RewardFailed`
marks the trajectory failed.
"""

from __future__ import annotations

from molt_core.hookspecs import hookimpl
from molt_plugins.rewards.basic import exact_match, regex


@hookimpl
def molt_register_rewards(register):
    """Register ``exact_match``, ``regex``, ``math_answer``, ``code_tests`` and ``llm_judge``
    (the judge of :mod:`molt_plugins.judges.llm_judge` used as a reward)."""
    from molt_plugins.judges.llm_judge import llm_judge
    from molt_plugins.rewards.code import code_tests
    from molt_plugins.rewards.math_answer import math_answer

    register("exact_match", exact_match)
    register("regex", regex)
    register("math_answer", math_answer)
    register("code_tests", code_tests)
    register("llm_judge", llm_judge)
