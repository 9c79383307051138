"""``ringlet.distributed.checkpoint.format_utils``: single-file conversion (re-exports only)."""

from ringlet.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp"]
