"""FULL CUDA graphs on D: only P, whose layer hooks push, makes vLLM fall back to
piecewise graphs. Checked through vLLM's own VllmConfig (its post-init asks the
connector class), with the platform's static-graph support switched on: the CPU
platform skips the question otherwise (nothing else is faked). The controls: P loses
full graphs, and a connector that cannot tell the role (the old answer) takes D's too.
"""
from unittest import mock

import pytest
from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig
from vllm.platforms import current_platform

from torch_kvops.integrations.vllm import connector as connector_module

pytestmark = [pytest.mark.unit, pytest.mark.vllm]


def _cudagraph_mode(kv_role: str):
    with mock.patch.object(type(current_platform), "support_static_graph_mode",
                           classmethod(lambda cls: True)):
        config = VllmConfig(
            kv_transfer_config=KVTransferConfig(kv_connector="KvopsLayerwiseConnector",
                                                kv_connector_module_path="torch_kvops.integrations.vllm",
                                                kv_role=kv_role),
            compilation_config=CompilationConfig(cudagraph_mode="FULL_AND_PIECEWISE"))
    return config.compilation_config.cudagraph_mode


@pytest.mark.parametrize("blind", [False, True], ids=["role_known", "control_role_unknown"])
def test_decode_keeps_full_cuda_graphs_and_prefill_does_not(blind):
    if blind:  # the sabotage: the role cannot be found, as before this was built
        with mock.patch.object(connector_module, "_kv_role_of", lambda extra: None):
            decode = _cudagraph_mode("kv_consumer")
        assert not decode.has_full_cudagraphs(), decode
        return
    decode = _cudagraph_mode("kv_consumer")
    assert decode.has_full_cudagraphs(), decode
    prefill = _cudagraph_mode("kv_producer")
    assert not prefill.has_full_cudagraphs(), prefill
