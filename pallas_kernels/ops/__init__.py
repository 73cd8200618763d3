"""The hot paths' pure math, one op per module (docs/design.md §T5): jax, numpy and stdlib only.

| module             | ops                                                                      |
|--------------------|--------------------------------------------------------------------------|
| `quant`            | E2M1/E4M3 grids, FP4 main-KV / MXFP4 / FP8 SWA formats, `fake_quant_*`   |
| `norm`             | `rms_norm`                                                               |
| `mhc`              | `sinkhorn_project`, `hc_mix`, `hc_coefficients`, `collapse`, `expand`, `hc_site` |
| `sparse_attention` | `attend` (window ∪ selected entries ∪ sink, one softmax; "masked"/"gather") |
| `indexer`          | `indexer_scores`, `entry_visible`, `select_topk`, the candidate pool, `score_and_select` |
| `grouped_matmul`   | `grouped_matmul` (the routed experts' grouped product, `ragged_dot`)     |
| `paths`            | `path_str` (a parameter's name)                                          |

The ops with kernels are registered in `pallas_kernels.dispatch`, under the names
`fake_quant_{fp4_main_kv,mxfp4,fp8_swa}`, `hc_coefficients`, `hc_site`, `sparse_attention`,
`indexer_topk` and `grouped_matmul`.
"""
