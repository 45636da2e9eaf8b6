"""What runs per token: the kernels' Python surface (:mod:`.kernels`), the expert cache and its
policies (:mod:`.cache`, :mod:`.policies`), the engines that serve a model's experts (the CPU
:mod:`.engine`, the GPU :mod:`.gpu_engine` over :mod:`.cuda`) and what they own (the offloaded
experts module :mod:`.experts`, miss handling :mod:`.misses`, the low-bit copies
:mod:`.expert_copy`, draft lookahead :mod:`.lookahead`, trace recording :mod:`.recording`,
the KV buffers :mod:`.kvcache`, the tau tables :mod:`.tau_tables`)."""
