"""pytest setup: ``gpu`` marker skips without CUDA; CPU compile checks pin the arch."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Compile checks on a machine without a GPU must target Hopper explicitly
# (the CuTe DSL otherwise silently targets sm_100a).
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


HAS_CUDA = _has_cuda()


#: The ``sanitize`` subset (scripts/gpu_sanitize.sh runs ``-m "gpu and sanitize"`` under
#: compute-sanitizer memcheck / racecheck / synccheck): per GPU test file, small-shape GPU tests that
#: together launch every kernel of the file. Entries are test names (exact), or a prefix of
#: ``name[parameter ids]`` ending in ``*`` (robust to parameters added later). tests/test_validation.py checks that every
#: file with a GPU test has entries and that every entry names a collected GPU test.
SANITIZE = {
    "test_attn_lists.py": ["test_gpu_cuda_graph_capture[swa*", "test_gpu_cuda_graph_capture[csa*",
                           "test_gpu_cuda_graph_capture[hca*"],
    "test_dequant_fp4.py": ["test_gpu_providers_bit_exact[3-96-out_dtype0-mxfp4*",
                            "test_gpu_providers_bit_exact[3-96-out_dtype1-nvfp4*",
                            "test_gpu_providers_bit_exact[257-4160-out_dtype1-mxfp4*",
                            "test_gpu_misaligned_data_is_rejected"],
    "test_distributed.py": ["test_ep_moe_tp_heads_nccl[1*"],
    "test_dsl_fp8_gemm.py": ["test_gpu_small_integers_exact_persistent_tail_tiles[direct*",
                             "test_gpu_small_integers_exact_persistent_tail_tiles[tma*",
                             "test_gpu_cluster_pair_small_integers_exact[direct*"],
    "test_formats.py": ["test_gpu_matches_cpu"],
    "test_fp4_decode.py": ["test_dsl_decode_matches_models_on_gpu"],
    "test_fuzz_specs.py": ["test_accepted_layouts_match_the_reference_gpu[dequant_fp4*"],
    "test_graph_capture.py": ["test_cuda_graph_capture_and_replay[cuda*"],
    "test_indexer.py": ["test_gpu_cache_write_and_q_quant_bytes[False-mxfp4*",
                        "test_gpu_cache_write_and_q_quant_bytes[True-nvfp4*",
                        "test_gpu_cache_write_and_q_quant_bytes[False-fp8*",
                        "test_gpu_out_of_range_slots_and_pages_match_reference[nvfp4*"],
    "test_indexer_dsl.py": ["test_gpu_dsl_paged_contract[1-mxfp4*", "test_gpu_dsl_paged_contract[2-fp8*",
                            "test_gpu_dsl_prefill_short_rows[lens_0-mxfp4-e4m3*",
                            "test_gpu_dsl_prefill_short_rows[lens_0-fp8-bf16*",
                            "test_gpu_dsl_prefill_nvfp4_bf16[lens_0*", "test_gpu_fp8_rows_conversion_matches_model"],
    "test_indexer_quant.py": ["test_gpu_cache_write_bit_exact[slot_dtype1-True-mxfp4*",
                              "test_gpu_cache_write_bit_exact[slot_dtype0-False-nvfp4*",
                              "test_gpu_cache_write_bit_exact[slot_dtype1-True-fp8*",
                              "test_gpu_q_quant_bit_exact[True-mxfp4*", "test_gpu_q_quant_bit_exact[False-nvfp4*"],
    "test_indexer_topk_paged.py": ["test_gpu_ties_and_short_rows"],   # logits kernel + topk op
    "test_kv_cache.py": ["test_gpu_append_matches_reference_bytes[False-fp8_ds_mla*",
                         "test_gpu_append_matches_reference_bytes[True-bf16*",
                         "test_gpu_gather_matches_reference[fp8_ds_mla*", "test_gpu_gather_isolation_past_lens*",
                         "test_gpu_compress_prefill_matches_reference[128-4-q*",
                         "test_gpu_compress_prefill_matches_reference[512-4-bf16*",
                         "test_gpu_decode_matches_reference_decode[128-4*"],
    "test_moe.py": ["test_gpu_small_layer_every_variant*"],
    "test_moe_decode.py": ["test_gpu_decode_matches_oracles[mmasync-1-fp8-mxfp4*",
                           "test_gpu_decode_matches_oracles[mmasync-3-bf16-nvfp4*",
                           "test_gpu_decode_matches_oracles[wgmma-3-fp8-nvfp4*",
                           "test_gpu_dsl_decode_matches_oracles[dsl-1-bf16-nvfp4*"],
    "test_moe_eager.py": ["test_gpu_route_fused_gate_matches_reference[bf16-fp32-17-7-520-False]",   # gate GEMM in
                          "test_gpu_route_fused_gate_matches_reference[bf16-bf16-9-256-4096-True]"],  # the route call
    "test_moe_glue.py": ["test_gpu_permute_bit_exact[fp8-contiguous-37-9-3-256*",
                         "test_gpu_permute_bit_exact[fp8-masked-37-9-3-256*",
                         "test_gpu_permute_bit_exact[bf16-contiguous-37-9-3-256*",
                         "test_gpu_combine_bit_exact[out_dtype1-1-6-4096-6*",
                         "test_gpu_route_matches_reference[gate_dtype1-7-False-0.1*",
                         "test_gpu_route_matches_reference[gate_dtype0-256-True-0.0*",
                         "test_gpu_bad_expert_ids_every_provider_subprocess"],
    "test_quantize.py": ["test_gpu_nvfp4_bitexact[linear-(3, 80)*", "test_gpu_nvfp4_bitexact[swizzled-(129, 4096)*",
                         "test_gpu_mxfp4_bitexact[dsv4-(300, 1056)*", "test_gpu_mxfp4_bitexact[ocp-(1, 7168)*",
                         "test_gpu_fp8_block_bitexact[128-(300, 1024)*", "test_gpu_fp8_block_bitexact[32-(16, 7168)*",
                         "test_gpu_dequant_fp8_bitexact[out_dtype0-128-(300, 1024)*",
                         "test_gpu_nvfp4_all_zero_and_reverse_off*",
                         "test_gpu_fp4_nan_inf_rule_by_value*"],
    "test_sparse_attention.py": ["test_dsl_matches_reference[3-short-16*", "test_dsl_matches_reference[None-hca-64*",
                                 "test_dsl_adversarial_lists[16*", "test_dsl_odd_heads_and_lengths_outside_the_list[24*"],
    "test_validation.py": ["test_gpu_kv_compress_bad_values_device_rule_subprocess"],
    "test_plan_cache.py": ["test_gpu_replay_small"],
    "test_topk.py": ["test_gpu_special_cases[cfg0*", "test_gpu_special_cases[cfg8*", "test_gpu_benchmark_sizes[randn-4-5000-777*",
                     "test_gpu_benchmark_sizes[ties-8-8192-1*", "test_gpu_prefill_and_block_table[cfg0*"],
}


def sanitize_selected(file_name: str, test_name: str) -> bool:
    """Is ``test_name`` (``name[ids]``) of ``tests/<file_name>`` in the :data:`SANITIZE` subset?"""
    return any(test_name.startswith(p[:-1]) if p.endswith("*") else test_name == p
               for p in SANITIZE.get(file_name, ()))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and sanitize_selected(Path(str(item.fspath)).name, item.name):
            item.add_marker(pytest.mark.sanitize)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (sm_90a)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda_device():
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def _clear_plans() -> None:
    m = sys.modules.get("dsv4.ops._plan")
    if m is not None:
        m.clear()


@pytest.fixture(autouse=True)
def _fresh_eager_plans(monkeypatch):
    """Every test starts without eager plans (dsv4/ops/_plan.py), and a ``monkeypatch`` of a module switch
    inside a test forgets them (a plan recorded before the switch must not outlive it)."""
    _clear_plans()
    for name in ("setattr", "delattr", "setitem", "delitem", "setenv", "delenv"):
        orig = getattr(monkeypatch, name)

        def patched(*a, _orig=orig, **k):
            r = _orig(*a, **k)
            _clear_plans()
            return r
        setattr(monkeypatch, name, patched)
    yield
    _clear_plans()
