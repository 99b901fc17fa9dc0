"""Files in and out: result files written safely (:mod:`~spectra.io.files`), model
checkpoints (:mod:`~spectra.io.checkpoints`) and datasets (:mod:`~spectra.io.datasets`).
Imports nothing else of spectra."""
