"""Rollouts: the task streams an agent's splits feed, eval statistics, and the isolated reward
worker process (:mod:`molt_core.rollout.tasks`, :mod:`~molt_core.rollout.evalstats`,
:mod:`~molt_core.rollout.datafiles`, :mod:`~molt_core.rollout.reward_worker`)."""
