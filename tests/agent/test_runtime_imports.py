"""The agent ships alone to GPU machines: its runtime must not pull in Django or the control plane."""

import subprocess
import sys

MODULES = [
    "agent", "cli", "config", "control_plane", "engine", "hardware", "reconciler", "standby",
    "standby_process", "supervisor", "tiny_model", "weights", "weights_index", "weights_sources", "zygote",
    "sleep_mode", "shared_memory", "reaper", "process", "engine_disk",
]


def test_runtime_imports_no_django_and_no_control_plane_app():
    code = (
        "import sys\n"
        + "".join(f"import gpu_agent.runtime.{name}\n" for name in MODULES)
        + "bad = sorted(m for m in sys.modules if m.split('.')[0] in {'django', 'controlplane', 'endpoints', 'billing'})\n"
        + "assert not bad, bad\n"
        + "heavy = sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules)\n"
        + "assert not heavy, heavy\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}
    )
    assert result.returncode == 0, result.stderr


def test_engine_module_is_import_light_for_the_control_plane():
    """The control plane imports `engine` for `supported_quantizations()`: stdlib only, no torch or vLLM."""
    code = (
        "import sys, gpu_agent.runtime.engine as e; e.supported_quantizations('cpu')\n"
        "roots = {m.split('.')[0] for m in sys.modules}\n"
        "print(sorted(r for r in roots if r not in sys.stdlib_module_names and not r.startswith('_')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['gpu_agent']"
