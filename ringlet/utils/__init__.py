"""``ringlet.utils``: mirrors of torch.utils' distributed parts
(``ringlet.utils.data.distributed``)."""

__all__: list[str] = []
