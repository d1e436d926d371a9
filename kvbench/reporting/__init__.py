"""Tables, the papers' figures, the HTML page, W&B, and the sweep-summary callback, all from stored records."""

import matplotlib

matplotlib.use("Agg")  # figures are files: no display, before any submodule imports pyplot
