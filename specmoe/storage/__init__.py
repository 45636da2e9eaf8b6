"""The slow tier: the expert store file (:mod:`.store`), checkpoint conversion into it
(:mod:`.conversion`) and the weight formats experts are stored in (:mod:`.quant`)."""
