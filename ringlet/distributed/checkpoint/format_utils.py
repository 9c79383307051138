"""``ringlet.distributed.checkpoint.format_utils``: single-file conversion (re-exports), and
torch's command line ``python -m ringlet.distributed.checkpoint.format_utils
{dcp_to_torch,torch_to_dcp} SRC DST``."""

from ringlet.checkpoint.cli import format_utils_main
from ringlet.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

__all__ = ["dcp_to_torch_save", "torch_save_to_dcp"]

if __name__ == "__main__":
    format_utils_main()
