"""One module per claim; importing this package registers them all (`kvbench analyze --list`)."""

from kvbench.analysis.claims import (  # noqa: F401
    adakv_concentration,
    adakv_eviction_loss,
    adakv_toy,
    ctkvr_dedup_alpha,
    ctkvr_query_similarity,
    ctkvr_topk_overlap,
    keydiff_dissimilarity,
    keydiff_geometry,
    keydiff_key_pca,
    keydiff_key_volume,
    keydiff_outlier_keys,
    omnikv_interlayer,
    omnikv_sparsity,
    omnikv_static_set,
    rocketkv_unique_topk,
)
