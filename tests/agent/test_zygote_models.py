"""The zygote's per-model look-ups (`gpu_agent/runtime/zygote_models.py`) with vLLM's real functions and the tiny model.

Each test runs in a fresh process (the wrappers patch vLLM's modules) on its own copy of the tiny model: forked from
one that imported vLLM's look-up modules and nothing else (`tests.agent.vllm_fork_server`).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm

TIMEOUT_S = 300

PRELUDE = (
    "import json, os, sys\n"
    "from pathlib import Path\n"
    "from gpu_agent.runtime import zygote_models\n"
    "zygote_models.install()\n"
    "from vllm.tokenizers import registry\n"
    "from vllm.transformers_utils import config as hf\n"
    "MODEL = sys.argv[1]\n"
    "PROBE = \"{{ 'probe' }}\"\n"
    "def tokenizer():\n"
    "    return registry.cached_get_tokenizer(MODEL, runner_type='generate', tokenizer_mode='auto',\n"
    "                                         revision=None, trust_remote_code=False)\n"
    "def config():\n"
    "    return hf.get_config(MODEL, False, None, None, 'auto', hf_overrides_kw={}, hf_overrides_fn=None, token=None)\n"
    "def rewrite(name, **changes):\n"
    "    path = Path(MODEL) / name\n"
    "    stat = path.stat()\n"
    "    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))\n"
    "    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a coarse clock still sees the change\n"
)


IN_CHILD = (
    "def in_child(body):\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        code = 1\n"
    "        try:\n"
    "            body(); code = 0\n"
    "        except BaseException as exc:\n"
    "            print('child:', repr(exc), file=sys.stderr)\n"
    "        os._exit(code)\n"
    "    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n"
    "def warm_all():\n"
    "    warmer = zygote_models.Warmer()\n"
    "    while warmer.warm_next():\n"
    "        pass\n"
    "    return warmer\n"
)


@pytest.fixture(scope="module")
def fork_server():
    """`python -m tests.agent.vllm_fork_server`, ready; stopped, with whatever it forked, after the module."""
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.agent.vllm_fork_server"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert _answer(server) == "ready"
        yield server
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def _answer(server: subprocess.Popen) -> str:
    if not select.select([server.stdout], [], [], TIMEOUT_S)[0]:
        raise TimeoutError(f"no answer from the fork server in {TIMEOUT_S} s")
    return server.stdout.readline().strip()


@pytest.fixture
def run(fork_server, tmp_path):
    """Runs `code` with the model folder as its argument in a process of its own (as `python -c`); fails with its
    output unless it exits 0."""
    log_path = tmp_path / "script.log"

    def run(code: str, model_dir, env: dict | None = None) -> None:
        request = {"code": PRELUDE + code, "argv": [str(model_dir)], "env": env or {}, "log_path": str(log_path)}
        fork_server.stdin.write(json.dumps(request) + "\n")
        fork_server.stdin.flush()
        code = int(_answer(fork_server))
        output = log_path.read_text()
        sys.stderr.write(output)
        assert code == 0, f"the script exited {code}:\n{output[-4000:]}"

    return run


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    return shutil.copytree(tiny_model_dir, tmp_path / "model")


def test_a_changed_tokenizer_or_config_file_misses_the_cache(model_copy, run):
    # vLLM's own cache (`lru_cache` by name) keeps answering from the files it first read: a node whose weights
    # directory was replaced in place would serve the old tokenizer. The look-ups here key on the files too.
    code = (
        "first, cfg = tokenizer(), config()\n"
        "assert tokenizer() is first, 'unchanged files: the same tokenizer'\n"
        "assert config() is not cfg and config().to_dict() == cfg.to_dict(), 'a config: a copy each call'\n"
        "import functools\n"
        "stale_cache = functools.lru_cache(registry.get_tokenizer)  # vLLM's own `cached_get_tokenizer`: by name\n"
        "stale_first = stale_cache(MODEL, runner_type='generate', tokenizer_mode='auto', revision=None,\n"
        "                          trust_remote_code=False)\n"
        "rewrite('tokenizer_config.json', chat_template=PROBE)\n"
        "rewrite('config.json', inferplane_probe=1)\n"
        "assert tokenizer() is not first and tokenizer().chat_template == PROBE, tokenizer().chat_template\n"
        "assert getattr(config(), 'inferplane_probe', None) == 1\n"
        "assert stale_cache(MODEL, runner_type='generate', tokenizer_mode='auto', revision=None,\n"
        "                   trust_remote_code=False).chat_template != PROBE, 'the rule this file guards against'\n"
        "assert stale_first.chat_template != PROBE\n"
    )
    run(code, model_copy)


def test_forked_engines_reuse_what_the_zygote_loaded_from_the_record_and_never_a_stale_answer(model_copy, run, tmp_path):
    # An engine's misses go to the node's record; the zygote loads them between handoffs; the next engine forked
    # answers from memory (its vLLM function is never called), until a file of the model changes.
    code = (
        "def in_child(body):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        code = 1\n"
        "        try:\n"
        "            body(); code = 0\n"
        "        except BaseException as exc:\n"
        "            print('child:', repr(exc), file=sys.stderr)\n"
        "        os._exit(code)\n"
        "    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n"
        "def first_engine():\n"
        "    tokenizer(); config()\n"
        "def no_disk():\n"
        "    def refuse(*args, **kwargs):\n"
        "        raise AssertionError('read from disk')\n"
        "    for lookup in zygote_models.LOOKUPS.values():\n"
        "        lookup.function = refuse\n"
        "    assert tokenizer().chat_template != PROBE\n"
        "    config()\n"
        "assert in_child(first_engine) == 0\n"
        "record = zygote_models.record_path().read_text().splitlines()\n"
        "assert {json.loads(line)['lookup'] for line in record} == {'get_config', 'cached_get_tokenizer'}, record\n"
        "assert zygote_models.LOOKUPS['cached_get_tokenizer'].answers == {}, 'the child loaded, not this process'\n"
        "assert in_child(no_disk) != 0, 'nothing loaded ahead yet'\n"
        "warmer = zygote_models.Warmer()\n"
        "while warmer.warm_next():\n"
        "    pass\n"
        "assert warmer.num_warmed == len(record), (warmer.num_warmed, record)\n"
        "assert not warmer.warm_next(), 'loaded once'\n"
        "assert in_child(no_disk) == 0, 'a forked engine answers from memory'\n"
        "rewrite('tokenizer_config.json', chat_template=PROBE)\n"
        "assert in_child(no_disk) != 0, 'a changed file is read again'\n"
        "assert in_child(lambda: tokenizer().chat_template == PROBE or sys.exit(3)) == 0\n"
        "# A record line asking for remote code is never repeated by the zygote.\n"
        "call = json.dumps([[MODEL], {'trust_remote_code': True}], sort_keys=True)\n"
        "with open(zygote_models.record_path(), 'a') as handle:\n"
        "    handle.write(json.dumps({'lookup': 'cached_get_tokenizer', 'call': call}) + '\\n')\n"
        "loaded = []\n"
        "zygote_models.LOOKUPS['cached_get_tokenizer'].function = lambda *a, **k: loaded.append(k)\n"
        "while warmer.warm_next():\n"
        "    pass\n"
        "assert not any(k.get('trust_remote_code') for k in loaded), loaded\n"
    )
    data_dir = tmp_path / "agent"
    data_dir.mkdir()
    run(code, model_copy, env={"INFERPLANE_DATA_DIR": str(data_dir)})


@pytest.mark.parametrize("args, kwargs", [
    (["MODEL", 1], {}),  # transformers takes any true value as trust
    (["MODEL", "yes"], {}),
    (["MODEL", False], {"trust_remote_code": 1}),
    (["MODEL"], {"trust_remote_code": "true"}),
])
def test_a_recorded_call_with_any_trust_remote_code_but_false_is_never_repeated_in_the_zygote(args, kwargs, tmp_path):
    from gpu_agent.runtime import zygote_models

    (tmp_path / "config.json").write_text("{}")  # an existing model directory: only the trust argument refuses it
    args = [str(tmp_path) if arg == "MODEL" else arg for arg in args]
    assert zygote_models._call_text(tuple(args), kwargs) is None
    loaded = []
    lookup = zygote_models._Lookup("get_config", lambda *a, **k: loaded.append((a, k)), copy_answer=True)
    # The line an engine could append to the node's record: the zygote runs nothing for it.
    assert not lookup.warm(json.dumps([args, kwargs], sort_keys=True))
    assert loaded == [] and lookup.answers == {}
    honest = json.dumps([[str(tmp_path), False], {}], sort_keys=True)
    assert zygote_models._call_text((str(tmp_path), False), {}) == honest
    assert lookup.warm(honest) and len(loaded) == 1


def test_a_huge_chat_template_or_a_slow_look_up_never_holds_the_zygote_past_its_budget(model_copy, run, tmp_path):
    # A tenant's tokenizer_config.json with a 2 MB chat template took the zygote ~30 s to compile between
    # handoffs: every handoff of the node meanwhile timed out, holding the agent's supervisor lock, and its
    # heartbeats stopped. Its template is now left to its engines, and any look-up repeated here has a budget.
    code = (
        "import time\n"
        "template = \"{% for m in messages %}\" + \"{% if m.role == 'x' %}{{ m.content }}{% endif %}\" * 40000 + \"{% endfor %}\"\n"
        "rewrite('tokenizer_config.json', chat_template=template)\n"
        "assert len(template) > zygote_models.MAX_WARMED_TEMPLATE_CHARS\n"
        "call = json.dumps([[MODEL], {'revision': None, 'runner_type': 'generate', 'tokenizer_mode': 'auto',\n"
        "                             'trust_remote_code': False}], sort_keys=True)\n"
        "with open(zygote_models.record_path(), 'a') as handle:\n"
        "    handle.write(json.dumps({'lookup': 'cached_get_tokenizer', 'call': call}) + '\\n')\n"
        "warmer = zygote_models.Warmer()\n"
        "started = time.monotonic()\n"
        "assert warmer.warm_next() and warmer.num_warmed == 1\n"
        "assert time.monotonic() - started < 10, time.monotonic() - started\n"
        "# A look-up that runs long (swallowing what it can) is given up on at the budget, and not tried again.\n"
        "zygote_models.WARM_BUDGET_S = 1.0\n"
        "def stubborn(*args, **kwargs):\n"
        "    while True:\n"
        "        try:\n"
        "            time.sleep(60)\n"
        "        except Exception:\n"
        "            pass\n"
        "zygote_models.LOOKUPS['get_config'].function = stubborn\n"
        "slow = json.dumps([[MODEL, False, None, None, 'auto'], {}], sort_keys=True)\n"
        "with open(zygote_models.record_path(), 'a') as handle:\n"
        "    handle.write(json.dumps({'lookup': 'get_config', 'call': slow}) + '\\n')\n"
        "started = time.monotonic()\n"
        "assert warmer.warm_next(), 'a failed look-up ends the wake-up too'\n"
        "assert time.monotonic() - started < 5, time.monotonic() - started\n"
        "assert ('get_config', slow) in warmer._failed\n"
        "assert not warmer.warm_next()\n"
    )
    data_dir = tmp_path / "agent"
    data_dir.mkdir()
    run(code, model_copy, env={"INFERPLANE_DATA_DIR": str(data_dir)})


def test_a_config_that_sets_a_variable_while_loading_leaves_no_trace_in_engines_forked_after_the_zygote_loaded_it(
    model_copy, run, tmp_path
):
    # vLLM's `get_config` sets VLLM_USE_DEEP_GEMM_E8M0=1 in `os.environ` for a config asking for UE8M0 scales: the
    # zygote loading tenant A's config ahead put it in the environment of every engine forked after, any tenant's.
    code = IN_CHILD + (
        "rewrite('config.json', quantization_config={'scale_fmt': 'ue8m0'})\n"
        "assert 'VLLM_USE_DEEP_GEMM_E8M0' not in os.environ\n"
        "assert in_child(config) == 0, 'its first engine records the call'\n"
        "warmer = warm_all()\n"
        "assert 'VLLM_USE_DEEP_GEMM_E8M0' not in os.environ, 'the zygote keeps its own environment'\n"
        "assert in_child(lambda: 'VLLM_USE_DEEP_GEMM_E8M0' not in os.environ or sys.exit(3)) == 0\n"
        "# Its answer is not kept: its own engines load it, and set the variable for themselves as a plain launch.\n"
        "assert zygote_models.LOOKUPS['get_config'].answers == {} and warmer.num_warmed == 0\n"
        "assert in_child(lambda: config() and os.environ.get('VLLM_USE_DEEP_GEMM_E8M0') == '1' or sys.exit(3)) == 0\n"
        "assert not warmer.warm_next(), 'not tried again'\n"
    )
    data_dir = tmp_path / "agent"
    data_dir.mkdir()
    run(code, model_copy, env={"INFERPLANE_DATA_DIR": str(data_dir)})


def test_one_tenants_config_loaded_ahead_never_changes_the_model_type_another_tenants_engine_sees(
    model_copy, run, tmp_path
):
    # vLLM registers its own config classes for some model types and sets the class's `model_type` to the
    # checkpoint's: "deepseek_v32" and "kimi_k2" share transformers' DeepseekV3Config. Loaded ahead one after the
    # other in the zygote, tenant B's cached deepseek_v32 config then said "kimi_k2" in its `to_dict()` (what vLLM
    # serialises and hashes) in every engine forked after, and AutoConfig kept both tenants' registrations.
    other = shutil.copytree(model_copy, tmp_path / "other")
    code = IN_CHILD + (
        "OTHER = os.environ['OTHER_MODEL']\n"
        "def config_of(model):\n"
        "    return hf.get_config(model, False, None, None, 'auto', hf_overrides_kw={}, hf_overrides_fn=None,\n"
        "                         token=None)\n"
        "rewrite('config.json', model_type='deepseek_v32')\n"
        "path = Path(OTHER) / 'config.json'\n"
        "path.write_text(json.dumps({**json.loads(path.read_text()), 'model_type': 'kimi_k2'}))\n"
        "assert in_child(lambda: config_of(MODEL)) == 0 and in_child(lambda: config_of(OTHER)) == 0\n"
        "warm_all()\n"
        "def sees(model, model_type):\n"
        "    config = config_of(model)\n"
        "    assert (config.model_type, config.to_dict()['model_type']) == (model_type, model_type), config.to_dict()\n"
        "assert in_child(lambda: sees(MODEL, 'deepseek_v32')) == 0 and in_child(lambda: sees(OTHER, 'kimi_k2')) == 0\n"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
        "assert not {'deepseek_v32', 'kimi_k2'} & set(CONFIG_MAPPING._extra_content), CONFIG_MAPPING._extra_content\n"
        "from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config\n"
        "assert DeepseekV3Config.model_type == 'deepseek_v3', DeepseekV3Config.model_type\n"
    )
    data_dir = tmp_path / "agent"
    data_dir.mkdir()
    run(code, model_copy, env={"INFERPLANE_DATA_DIR": str(data_dir), "OTHER_MODEL": str(other)})


def test_a_look_up_interrupted_at_its_budget_leaves_none_of_its_changes_to_the_engines(tmp_path, monkeypatch):
    # The alarm (`WarmTooLong`) can stop library code halfway through a change every engine forked afterwards
    # would inherit; what the zygote knows to watch is put back after the alarm is off.
    import os
    import time

    from gpu_agent.runtime import zygote_models

    def stubborn(*args, **kwargs):
        os.environ["VLLM_USE_DEEP_GEMM_E8M0"] = "1"
        while True:
            try:
                time.sleep(60)
            except Exception:  # noqa: BLE001 - as a library's own fallback would
                pass

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("INFERPLANE_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("VLLM_USE_DEEP_GEMM_E8M0", raising=False)
    monkeypatch.setattr(zygote_models, "WARM_BUDGET_S", 0.5)
    lookup = zygote_models._Lookup("get_config", stubborn, copy_answer=True)
    monkeypatch.setitem(zygote_models.LOOKUPS, "get_config", lookup)
    call = json.dumps([[str(model), False], {}], sort_keys=True)
    zygote_models.record_path().write_text(json.dumps({"lookup": "get_config", "call": call}) + "\n")
    warmer = zygote_models.Warmer()
    assert warmer.warm_next()
    assert "VLLM_USE_DEEP_GEMM_E8M0" not in os.environ
    assert ("get_config", call) in warmer._failed and lookup.answers == {}


def test_a_config_a_module_registers_as_the_zygote_imports_it_during_a_look_up_stays_registered(tmp_path, monkeypatch):
    # vLLM's Ovis config registers its sub-configs with AutoConfig when imported. Imported during a look-up in the
    # zygote, the module stays imported in every engine forked afterwards, which would never register them again:
    # put back, an Ovis model's engines could not load their config.
    import sys

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from gpu_agent.runtime import zygote_models

    (tmp_path / "inferplane_probe_configs.py").write_text(
        "from transformers import AutoConfig, PretrainedConfig\n"
        "class ProbeSubConfig(PretrainedConfig):\n"
        "    model_type = 'inferplane_probe_sub'\n"
        "AutoConfig.register('inferplane_probe_sub', ProbeSubConfig)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(CONFIG_MAPPING, "_extra_content", dict(CONFIG_MAPPING._extra_content))
    monkeypatch.delitem(sys.modules, "inferplane_probe_configs", raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")

    def load(*args, **kwargs):
        import inferplane_probe_configs  # noqa: F401

        return {"loaded": True}

    monkeypatch.setenv("INFERPLANE_DATA_DIR", str(tmp_path))
    lookup = zygote_models._Lookup("get_config", load, copy_answer=True)
    monkeypatch.setitem(zygote_models.LOOKUPS, "get_config", lookup)
    call = json.dumps([[str(model), False], {}], sort_keys=True)
    zygote_models.record_path().write_text(json.dumps({"lookup": "get_config", "call": call}) + "\n")
    warmer = zygote_models.Warmer()
    assert warmer.warm_next() and warmer.num_warmed == 1 and lookup.answers
    assert "inferplane_probe_sub" in CONFIG_MAPPING._extra_content
