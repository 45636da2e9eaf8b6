"""The trace-driven simulator: replay of routing traces through the live C slot table and
policies (:mod:`.replay`), sweeps (:mod:`.sweep`), traces (:mod:`.traces`), hardware profiles
(:mod:`.hardware`) and their measurement (:mod:`.calibration`).  ``specmoe.simulate`` and
``specmoe.sweep`` are the entry points."""
