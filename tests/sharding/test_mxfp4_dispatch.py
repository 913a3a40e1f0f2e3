"""MXFP4 routed experts expert-parallel on 8 fake devices (a subprocess): the capacity and ragged
dispatches, with and without a split hidden width, in fp32 and bf16, equal the dense layer on the
decoded weights on one device (values and input gradients); with routed-expert LoRA adapters (QLoRA)
they equal the dense layer with the adapters merged (values, input and adapter gradients)."""
import pytest

from tests.sharding.test_multi_device import program, program_result

pytestmark = pytest.mark.slow   # a subprocess of 8 devices


def test_mxfp4_expert_parallel_equals_dense_decoded_on_one_device():
    results = program_result(program("mxfp4_dispatch"))
    assert len(results) == 10
    for case, result in results.items():
        # bf16 with the hidden width split sums the two halves' bf16 partial outputs: rounding differs
        tolerance = 1e-5 if case.endswith("fp32") else 2e-2
        assert result["dropped"] == 0, case
        assert result["loss"] <= tolerance and result["input_gradient"] <= tolerance, (case, result)
        if case.startswith("qlora"):
            assert result["adapter_gradient"] <= tolerance, (case, result)
            continue
        if case.endswith("fp32"):
            assert result["loss_vs_dense_on_mesh"] <= 1e-6, (case, result)
