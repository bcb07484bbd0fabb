"""Measuring instruments: the roofline model of a step (`roofline`, `params`) and the
online serving benchmark (`bench_serve`)."""
from dsv4.bench.params import LayerParams, ModelParams, layer_params, model_params
from dsv4.bench.roofline import (BF16, GPU, H200, RELEASED_FP8_FP4, Precision, RooflineTimes, StepCost,
                                bound_seconds, decode_step_cost, expected_experts_touched, prefill_cost,
                                roofline)

__all__ = ["BF16", "GPU", "H200", "RELEASED_FP8_FP4", "LayerParams", "ModelParams", "Precision",
           "RooflineTimes", "StepCost", "bound_seconds", "decode_step_cost", "expected_experts_touched",
           "layer_params", "model_params", "prefill_cost", "roofline"]
