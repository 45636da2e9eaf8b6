"""Speculative decoding: the loops (:mod:`.generation`, batches in :mod:`.batch`), the drafters
(:mod:`.drafters`, :mod:`.mtp`), the controllers that choose the draft length
(:mod:`.controllers`), acceptance (:mod:`.verify`, :mod:`.sampling`), the target's cost
tables (:mod:`.tau`) and the model calls they share (:mod:`.decoding`)."""
