"""System ablations on EMULATED hardware: one YAML per paper figure under flows/ablations/, each a
set of variants of an emulated flow, run side by side by the real runtime and reported next to
the paper's value and to each variant's own ideal (``rollart ablate NAME``)."""

from rollart_dask.tools.ablation.spec import AblationSpec, ablation_names, load_ablation  # noqa: F401
from rollart_dask.tools.ablation.measure import run_ablation  # noqa: F401
