"""Model families: the architecture tables (:mod:`.arch`), the C-backed torch modules
(:mod:`.layers`), the attention / MLA / decode-step adapters (:mod:`.attention`, :mod:`.mla`,
:mod:`.decode_step`, wired by :mod:`.dense`), checkpoints larger than memory
(:mod:`.pretrained`) and tiny test models (:mod:`.testing`)."""
