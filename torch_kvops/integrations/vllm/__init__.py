"""vLLM KV connector for layer-wise push: load it with

    --kv-transfer-config '{"kv_connector": "KvopsLayerwiseConnector",
                           "kv_connector_module_path": "torch_kvops.integrations.vllm", ...}'

Modules: ``connector`` (the KVConnectorBase_V1 subclass, dispatching by role),
``scheduler`` (request pairing, which blocks to push each step), ``worker`` (caches,
LayerwiseConnector hooks), ``side_channel`` (decode -> prefill destination messages),
``metadata`` (what the scheduler hands the worker, settings). See docs/vllm.md.
"""
from .connector import KvopsLayerwiseConnector
from .metadata import KvopsSettings

__all__ = ["KvopsLayerwiseConnector", "KvopsSettings"]
