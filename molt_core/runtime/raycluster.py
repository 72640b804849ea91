"""Start or join the Ray cluster of ``molt run``, with Ray's token authentication on.

Ray 2.60 binds its GCS, raylet and worker gRPC servers to every interface (``::`` /
``0.0.0.0``) whatever ``node_ip_address`` says (the binding is hard-coded in Ray's C++
``GrpcServer``; upstream ray-project/ray#59852 moves it to the node IP in a later release),
so a loopback-only local cluster cannot be had through Ray's options. What closes those
ports is Ray's token authentication (``RAY_AUTH_MODE=token``): every gRPC call without the
cluster's token is refused with ``UNAUTHENTICATED``.

* A local cluster (no ``--ray-address``) gets a fresh random token per run, held only in
  this process's environment (``RAY_AUTH_TOKEN``) and inherited by the Ray processes it
  starts -- nothing is written to ``~/.ray``. A token or mode the user set is kept.
* Joining a cluster (``--ray-address``) turns token authentication on too; the token is
  the one the cluster was started with, read by Ray from ``RAY_AUTH_TOKEN``,
  ``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token``. With none of them the run stops before
  connecting and says what to set; ``RAY_AUTH_MODE=disabled`` joins a cluster started
  without authentication.

Setting the mode explicitly also silences the warning Ray prints on every ``ray.init``.
See https://docs.ray.io/en/latest/ray-security/token-auth.html.
"""

from __future__ import annotations

import math
import os
import secrets
import sys
from typing import Any

from molt_core.config import RunConfig

__all__ = ["ClusterAuthError", "init_ray", "prepare_auth"]

AUTH_MODE = "RAY_AUTH_MODE"
AUTH_TOKEN = "RAY_AUTH_TOKEN"
AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"


class ClusterAuthError(ValueError):
    """A Ray without token authentication (before 2.52), or joining a cluster with token
    authentication on but no token available."""


def _token_available(env: dict[str, str]) -> bool:
    """True when Ray would find a token, in its own order: ``RAY_AUTH_TOKEN``, the file
    ``RAY_AUTH_TOKEN_PATH``, ``$HOME/.ray/auth_token``."""
    if env.get(AUTH_TOKEN, "").strip():
        return True
    if env.get(AUTH_TOKEN_PATH):
        return os.path.isfile(env[AUTH_TOKEN_PATH])
    home = env.get("HOME") or os.path.expanduser("~")
    return os.path.isfile(os.path.join(home, ".ray", "auth_token"))


def _refresh_ray_config() -> None:
    """Make an already-imported Ray re-read ``RAY_AUTH_*`` (it caches its config at first
    use; Ray's own ``_enable_token_auth`` does the same)."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # pragma: no cover - older Ray
        pass


def prepare_auth(ray_address: str | None, environ: dict[str, str] | None = None) -> str:
    """Set the ``RAY_AUTH_*`` variables of ``environ`` (default ``os.environ``) for a local
    cluster (``ray_address`` None) or for joining ``ray_address``; returns the mode in force
    (``"token"`` or what the user set).

    Local: unless ``RAY_AUTH_MODE`` is set, mode ``token`` with a fresh 256-bit random
    ``RAY_AUTH_TOKEN`` (kept if one is set already, or if ``RAY_AUTH_TOKEN_PATH`` names a file).
    Joining: unless ``RAY_AUTH_MODE`` is set, mode ``token``.

    Raises:
        ClusterAuthError: joining with mode ``token`` and no token found; the message names
            ``RAY_AUTH_TOKEN`` / ``RAY_AUTH_TOKEN_PATH`` / ``RAY_AUTH_MODE=disabled``.
    """
    env = os.environ if environ is None else environ
    mode = env.get(AUTH_MODE)
    if mode is not None:
        mode = mode.lower()
    if ray_address is None:
        if mode is None:
            env[AUTH_MODE] = mode = "token"
            if not env.get(AUTH_TOKEN) and not (env.get(AUTH_TOKEN_PATH) and os.path.isfile(env[AUTH_TOKEN_PATH])):
                env[AUTH_TOKEN] = secrets.token_hex(32)
        return mode
    if mode is None:
        env[AUTH_MODE] = mode = "token"
    if mode == "token" and not _token_available(env):
        raise ClusterAuthError(
            f"--ray-address {ray_address}: molt joins a cluster with Ray token authentication on, but no token was "
            f"found. Set {AUTH_TOKEN} to the cluster's token (print it on the head node with `ray get-auth-token`) "
            f"or {AUTH_TOKEN_PATH} to a file holding it; for a cluster started without authentication set "
            f"{AUTH_MODE}=disabled")
    return mode


def init_ray(cfg: RunConfig, ray_address: str | None) -> Any:
    """Start a fresh local Ray cluster, or join ``ray_address``, with token authentication
    (:func:`prepare_auth`) and the run's worker environment (``OMP_NUM_THREADS`` =
    ``run.threads``, offline Hugging Face). Ray's coloured log prefixes are turned off when
    stdout or stderr is not a terminal (``RAY_COLOR_PREFIX=0``), so redirected logs hold no
    ANSI codes. Returns the ``ray`` module.

    Raises:
        ClusterAuthError: Ray older than 2.52 (no token authentication), or see :func:`prepare_auth`.
    """
    prepare_auth(ray_address)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    import ray

    if tuple(int(p) for p in ray.__version__.split(".")[:2]) < (2, 52):
        raise ClusterAuthError(f"Ray {ray.__version__} has no token authentication (it arrived in Ray 2.52), so the "
                               f"cluster's ports would be open to any connection; pip install 'ray>=2.52'")
    if ray.is_initialized():
        return ray
    _refresh_ray_config()
    env = {"env_vars": {"OMP_NUM_THREADS": str(cfg.run.threads), "TOKENIZERS_PARALLELISM": "false",
                        # the driver's Hub settings reach every worker (Hub ids: molt_core.models)
                        **{k: os.environ[k] for k in ("HF_HUB_OFFLINE", "HF_HOME", "HF_TOKEN") if k in os.environ}}}
    if ray_address:
        ray.init(address=ray_address, runtime_env=env, log_to_driver=True, logging_level="warning")
    else:
        need = cfg.trainer.num_cpus * cfg.trainer.world_size + cfg.engine.num_cpus * cfg.engine.num_engines
        # address="local": always a fresh cluster, never a stale one left by `ray start`
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(need)), include_dashboard=False,
                 runtime_env=env, log_to_driver=True, logging_level="warning")
    short = gpu_shortfall(cfg, float(ray.cluster_resources().get("GPU", 0.0)))
    if short:
        if not ray_address:  # a local cluster never grows: Ray would wait for the GPUs forever
            ray.shutdown()
            raise ValueError(short)
        print(f"warning: {short} (waiting for the cluster to provide them)", file=sys.stderr)
    return ray


def gpu_shortfall(cfg: RunConfig, cluster_gpus: float) -> str | None:
    """Why the run's GPU request cannot be placed on a cluster with ``cluster_gpus`` GPUs, or
    None when it fits. The request is ``trainer.num_gpus * trainer.world_size +
    engine.num_gpus * engine.num_engines`` (GPUs, fractions allowed)."""
    tc, ec = cfg.trainer, cfg.engine
    need = tc.num_gpus * tc.world_size + ec.num_gpus * ec.num_engines
    if need <= cluster_gpus + 1e-9:
        return None
    return (f"the run needs {need:g} GPU(s) (trainer.num_gpus {tc.num_gpus:g} x trainer.world_size {tc.world_size} + "
            f"engine.num_gpus {ec.num_gpus:g} x engine.num_engines {ec.num_engines}) but the Ray cluster has "
            f"{cluster_gpus:g}; lower those options (e.g. --set trainer.num_gpus=0 --set engine.num_gpus=0 on a CPU "
            f"machine), or join a cluster with GPUs (--ray-address)")
