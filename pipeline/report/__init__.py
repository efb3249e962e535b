"""The HTML report of the built engines: ``skuforge report`` and the page publish uploads.

``write_site`` writes the whole site (an index, a cross-SKU page per model, a page per pair);
``write_pair_report`` writes one pair's self-contained ``report.html``. matplotlib is imported
only when a chart is drawn.
"""

from pipeline.report.common import DEFAULT_DIR, PAIR_REPORT
from pipeline.report.site import pages, write_pair_report, write_site

__all__ = ["DEFAULT_DIR", "PAIR_REPORT", "pages", "write_pair_report", "write_site"]
