"""``ls.autocast``: a float32 model run in float16 (or bfloat16), decided per equation by a
table of rules, everywhere in the program (README.md).

``rules.py`` is the table; ``rewrite.py`` the staged rewrite that reads it; ``policy.py``
where a user departs from it; ``function.py`` the public function; ``report.py`` what ran
in which dtype.
"""

from loss_scaling.autocast.function import autocast
from loss_scaling.autocast.policy import AutocastPolicy, Site
from loss_scaling.autocast.report import AutocastReport, autocast_report
from loss_scaling.autocast.rewrite import Row
from loss_scaling.autocast.rules import RULES, Rule

__all__ = ["RULES", "AutocastPolicy", "AutocastReport", "Row", "Rule", "Site", "autocast",
           "autocast_report"]
