"""A tenant's safetensors headers cost the agent time and memory in proportion to the tensors they describe, never
more, and no launch parses one: a header of `[0,0,…]` or `[{},{},…]` within every byte bound stalled the node's
heartbeats (parsed again under the supervisor's lock at each launch) until it went offline with every replica."""

from __future__ import annotations

import errno
import json
import shutil
import signal
import struct
import subprocess
import threading
import time

import pytest

from gpu_agent.protocol import ModelTask
from gpu_agent.runtime import engine, safetensors_headers
from gpu_agent.runtime.model_info import read_model
from gpu_agent.runtime.supervisor import Supervisor
from gpu_agent.runtime.weights import WeightsCache

from .conftest import cpu_used_s, fake_engine_factory, make_spec, with_peak_memory

# NOTE: what these tests assert is the headers' cost and count, not the tokenizer's description.
pytestmark = pytest.mark.usefixtures("tokenizer_not_described")

CONFIG = {"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 4096}


def write_model(folder, header: bytes, config: dict = CONFIG):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    with open(folder / "model.safetensors", "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
    return folder


def list_header(element: bytes, num_bytes: int) -> bytes:
    """`{"x":[e,e,…]}` of `num_bytes`: within every byte bound of a model's headers."""
    return b'{"x":[' + b",".join([element] * (num_bytes // (len(element) + 1))) + b"]}"


def many_tensors_header(num_tensors: int) -> bytes:
    """A real header's shape: a big mixture of experts' tensors, an FP8 weight and its scale each."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for index in range(num_tensors // 2):
        name = f"model.layers.{index // 256}.mlp.experts.{index % 256}.down_proj"
        header[f"{name}.weight"] = {"dtype": "F8_E4M3", "shape": [7168, 2048], "data_offsets": [offset, offset]}
        header[f"{name}.weight_scale_inv"] = {"dtype": "F32", "shape": [56, 16], "data_offsets": [offset, offset]}
    return json.dumps(header).encode()


def padded_with_tensor_keys(num_bytes: int) -> bytes:
    """A header that buys its budget with repeated `"data_offsets"` keys in `__metadata__`, then spends it on `[]`s:
    parsed in full, ~2 s of the GIL for 16 MiB."""
    num_lists = num_bytes * 3 // 26  # `[],` and a third of `"data_offsets":0,` each
    keys = b",".join([b'"data_offsets":0'] * (num_lists // 3 + 1))
    lists = b",".join([b"[]"] * num_lists)
    return b'{"__metadata__":{' + keys + b'},"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"z":[' + lists + b"]}}"


def test_a_heartbeat_after_a_restart_reads_no_tenants_headers(tmp_path):
    """Before, the first heartbeat after an agent restart parsed every cached model's headers on its own thread
    (readings are kept in memory only): 8 hostile models took ~15 s, ~16 passed the heartbeat grace and the node went
    offline with every tenant's replicas. Now it reports what was read (nothing yet) and the readings follow."""
    header = padded_with_tensor_keys(4 * 1024 * 1024)
    models = [write_model(tmp_path / f"hostile-{index}", header) for index in range(6)]
    models.append(write_model(tmp_path / "plain", many_tensors_header(10)))
    cache = WeightsCache(tmp_path / "weights")  # a restarted agent: nothing read yet
    for model in models:
        cache.fetch(str(model))
    started = time.monotonic()
    statuses = cache.statuses()  # what `Agent.build_heartbeat` calls on the heartbeat thread
    took_s = time.monotonic() - started
    assert took_s < 0.5, f"the heartbeat's weights took {took_s:.1f}s"
    assert len(statuses) == len(models) and all(status.model_info is None for status in statuses)
    deadline = time.monotonic() + 60
    while any(status.model_info is None for status in cache.statuses() if status.source == str(models[-1])):
        assert time.monotonic() < deadline, "the background reader never read the model"
        time.sleep(0.05)
    [plain] = [status for status in cache.statuses() if status.source == str(models[-1])]
    assert plain.model_info.num_params == 5 * (7168 * 2048 + 56 * 16)
    # A pull asking for a model the background reader is reading waits for that reading: one parse per model.
    assert cache.read_model(models[0]) is cache.read_model(models[0])


def test_a_header_that_buys_its_budget_with_tensor_keys_never_stalls_the_agents_threads(tmp_path):
    """Before, 16 MiB of `[]`s, their budget bought with repeated `"data_offsets"` keys, were parsed in the agent:
    ~2 s holding the GIL, every thread (heartbeats, the gateway's calls) stalled. Now the child process parses them."""
    model = write_model(tmp_path / "padded", padded_with_tensor_keys(16 * 1024 * 1024 - 4096))
    gaps, done = [], threading.Event()

    def tick():
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        reading, peak = with_peak_memory(lambda: read_model(model))
    finally:
        done.set()
        ticker.join()
    assert max(gaps) < 0.5, f"another thread of the agent stalled {max(gaps):.1f}s"
    assert reading.problem == "" and peak < 16 * 1024 * 1024  # the child parsed it (~160 MB before)


def test_headers_past_the_readers_limits_refuse_their_model(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_headers, "MAX_READER_MEMORY_BYTES", 160 * 1024 * 1024)
    reading = read_model(write_model(tmp_path / "padded", padded_with_tensor_keys(16 * 1024 * 1024 - 4096)))
    assert reading.info is None
    assert reading.problem == (
        "the model's files cannot be served: its safetensors headers take more than the node's reader may spend "
        "(20 s of CPU, 160 MiB of memory)"
    )
    assert read_model(write_model(tmp_path / "plain", many_tensors_header(10))).info.num_params > 0


def test_a_trillion_parameter_mixture_of_experts_is_counted(tmp_path):
    """Kimi-K2's 140,544 tensors take ~17 MB of headers: past the 16 MiB cap the count was unknown (None)."""
    reading = read_model(write_model(tmp_path / "kimi", many_tensors_header(140_544)))
    assert reading.problem == "" and reading.info.num_params == 70_272 * (7168 * 2048 + 56 * 16)


def test_an_engines_command_reads_no_safetensors_header(tmp_path):
    """Before, the default task (AUTO) and a CPU engine's KV cache each parsed every header again (15 M integers,
    a Python call each: seconds per launch, under the lock every heartbeat waits on)."""
    model = write_model(tmp_path / "model", list_header(b"0", 12 * 1024 * 1024))
    spec = make_spec(model_source=str(model), task=ModelTask.AUTO, max_model_len=None)
    for device in (engine.DEVICE_CUDA, engine.DEVICE_CPU):
        started = time.monotonic()
        command = engine.build_engine_command(spec, model, port=8001, device=device)
        took_s = time.monotonic() - started
        assert took_s < 0.5, f"building the {device} command took {took_s:.1f}s"
        assert "--runner" not in command.argv  # its config.json's architecture: a generative model
    # What the command needs still comes from config.json: an embedding architecture, the CPU cache from its context.
    write_model(tmp_path / "embedder", b"{}", {"architectures": ["BertModel"], "max_position_embeddings": 512})
    command = engine.build_engine_command(
        make_spec(task=ModelTask.AUTO), tmp_path / "embedder", port=8001, device=engine.DEVICE_CPU
    )
    assert "--runner" in command.argv


def test_a_launch_does_not_hold_up_the_heartbeats_statuses(tmp_path):
    model = write_model(tmp_path / "model", list_header(b"0", 12 * 1024 * 1024))
    fake = fake_engine_factory()

    def factory(spec, model_path, port):  # the agent's own factory's work, then a fake engine to run
        engine.build_engine_command(spec, model_path, port=port, device=engine.DEVICE_CPU)
        return fake(spec, model_path, port)

    supervisor = Supervisor(tmp_path / "agent", command_factory=factory)
    try:
        supervisor.start(make_spec("r-1", model_source=str(model), task=ModelTask.AUTO, max_model_len=None), model)
        poller = threading.Thread(target=supervisor.poll)
        poller.start()
        time.sleep(0.05)
        started = time.monotonic()
        supervisor.statuses()  # what every heartbeat calls (`Reconciler.replica_statuses`)
        waited_s = time.monotonic() - started
        poller.join()
        assert waited_s < 0.5, f"the heartbeat's statuses() waited {waited_s:.1f}s for one launch"
        assert supervisor.statuses()[0].pid is not None
    finally:
        supervisor.shutdown(timeout_s=1)


def test_a_header_of_more_values_than_its_tensors_can_hold_is_refused_unparsed(tmp_path):
    """`[0,0,…]` took a Python call per integer (seconds, holding the GIL), `[{},{},…]` ~25 times its size."""
    for element, name in ((b"0", "zeros"), (b"{}", "objects"), (b"[]", "lists")):
        model = write_model(tmp_path / name, list_header(element, 12 * 1024 * 1024))
        started = cpu_used_s()  # the reader's child included
        reading, peak = with_peak_memory(lambda model=model: read_model(model))
        took_s = cpu_used_s() - started
        assert reading.info is None
        assert reading.problem == (
            "the model's files cannot be served: the safetensors header of model.safetensors holds more values than "
            "its tensors (0 in the model's headers so far) can have"
        )
        assert took_s < 1, f"refusing the header of {name} took {took_s:.1f} s of CPU"
        assert peak < 2 * 12 * 1024 * 1024  # the header's bytes, read once: nothing parsed


def test_a_header_padded_with_tensor_keys_is_still_bounded(tmp_path):
    """Each `"data_offsets"` a header holds buys its values; one that holds more per key than a tensor can is refused."""
    per_tensor = b'{"data_offsets":[' + b",".join([b"0"] * 40) + b"]}"
    header = b'{"x":[' + b",".join([per_tensor] * 20_000) + b"]}"
    reading = read_model(write_model(tmp_path / "padded", header))
    assert "holds more values than its tensors" in reading.problem


def test_real_headers_of_many_tensors_and_tiny_models_are_still_counted(tmp_path, tiny_model_dir):
    header = many_tensors_header(90_000)  # DeepSeek-V3's count: ~12 MB of headers
    model = write_model(tmp_path / "big", header)
    started = cpu_used_s()  # the reader's child included
    reading = read_model(model)
    assert reading.problem == ""
    assert reading.info.num_params == 45_000 * (7168 * 2048 + 56 * 16)
    assert cpu_used_s() - started < 5
    # A tiny model split in two files (the budget is the model's, over all its headers), and as it is.
    assert read_model(tiny_model_dir).info.num_params > 0
    split = shutil.copytree(tiny_model_dir, tmp_path / "split")
    write_model(split, many_tensors_header(10), json.loads((tiny_model_dir / "config.json").read_text()))
    (split / "model.safetensors").rename(split / "model-00002-of-00002.safetensors")
    shutil.copy(tiny_model_dir / "model.safetensors", split / "model-00001-of-00002.safetensors")
    assert read_model(split).info.num_params == read_model(tiny_model_dir).info.num_params + 5 * (7168 * 2048 + 56 * 16)


def readers_answering(monkeypatch, *answers):
    """The header reader's child processes, the first ones answered by `answers` in turn (an exception is raised, a
    return code ends the child without output), the rest run as they are; the number of readers started."""
    real, queue, started = subprocess.run, list(answers), []

    def run(argv, *args, **kwargs):
        if safetensors_headers.__name__ not in argv:
            return real(argv, *args, **kwargs)
        started.append(1)
        if not queue:
            return real(argv, *args, **kwargs)
        answer = queue.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return subprocess.CompletedProcess(argv, answer, b"", b"")

    monkeypatch.setattr(subprocess, "run", run)
    return started


def test_a_reader_past_its_wall_time_or_killed_from_outside_refuses_nothing(tmp_path, monkeypatch):
    """The wall time is reachable on a loaded node and the OOM killer picks any child: before, either refused a
    legitimate model on that node for the agent's life. Only the reader's own limits refuse."""
    model = write_model(tmp_path / "plain", many_tensors_header(10))
    monkeypatch.setattr(safetensors_headers, "READER_TIMEOUT_S", 0.001)  # a real timeout, as under load
    reading = read_model(model)
    assert reading.problem == "" and reading.info is None
    assert reading.unsettled == "its safetensors headers took more than 0.001 s to read"
    monkeypatch.setattr(safetensors_headers, "READER_TIMEOUT_S", 60)
    readers_answering(monkeypatch, -signal.SIGKILL, OSError(errno.ENOMEM, "Cannot allocate memory"), -signal.SIGXCPU,
                      safetensors_headers.OUT_OF_MEMORY_EXIT)  # fmt: skip
    killed = read_model(model)
    assert killed.problem == "" and killed.unsettled.startswith("the safetensors header reader was killed")
    not_started = read_model(model)
    assert not_started.problem == "" and not_started.unsettled.endswith("could not start (Cannot allocate memory)")
    for _ in range(2):  # its CPU, its memory: refused
        assert read_model(model).problem.startswith("the model's files cannot be served: its safetensors headers take")
    assert read_model(model).info.num_params > 0


def test_the_cache_keeps_no_reading_that_gave_no_answer_and_heartbeats_read_it_again_after_a_back_off(
    tmp_path, monkeypatch
):
    model = write_model(tmp_path / "plain", many_tensors_header(10))
    cache = WeightsCache(tmp_path / "cache")
    cache.unsettled_retry_s = (0.5,)
    started = readers_answering(monkeypatch, subprocess.TimeoutExpired("reader", 60))
    assert cache.read_model(model).unsettled and cache.reading_made(model) is None
    time.sleep(0.2)
    assert cache.reading_made(model) is None and len(started) == 1  # within its back-off: not read again
    assert cache.read_model(model).info.num_params > 0  # a pull's own read: read again, and kept
    assert cache.reading_made(model).info.num_params > 0 and len(started) == 2
