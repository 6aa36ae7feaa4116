"""Prefill/decode disaggregation with real vLLM engines and KvopsLayerwiseConnector:
P, D and a monolithic reference, each prompt in every mode (monolithic, P/D layer-wise,
P/D push after the forward); prints one JSON line. The engines and the comparison live
in the package: this is ``python -m torch_kvops.serving.pd_compare`` (``--help`` lists
the options; ``--link 1gbit`` runs it inside an emulated link).
"""
from torch_kvops.serving.pd_compare import main

if __name__ == "__main__":
    main()
