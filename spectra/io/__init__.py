"""Files in and out: result files written safely (:mod:`~spectra.io.files`), model
checkpoints (:mod:`~spectra.io.checkpoints`), datasets (:mod:`~spectra.io.datasets`) and
the validation of result files read back (:mod:`~spectra.io.result_validation`). Imports
nothing else of spectra but the generic argument checks of :mod:`spectra._validation`."""
