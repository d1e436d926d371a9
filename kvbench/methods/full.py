"""Full cache: the uncompressed reference every method is compared with."""

from dataclasses import dataclass

from kvbench.methods.base import Method, register_method


@register_method
@dataclass
class Full(Method):
    name = "full"
    uses_budget = False
