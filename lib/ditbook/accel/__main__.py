"""``python -m ditbook.accel``: the technique table of ``docs/CONTRACTS.md``."""

from . import table_markdown

print(table_markdown())
