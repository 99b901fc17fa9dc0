"""``python -m spectra``: the command line of :mod:`spectra.cli`."""

from spectra.cli import main

raise SystemExit(main())
