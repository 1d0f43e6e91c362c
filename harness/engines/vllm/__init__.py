"""Everything about judging vLLM, in one folder: the engine (`engine`: vLLM's offline LLM in the
worker, its weights read before `process_weights_after_loading`), which formats its kernels run on
this machine (`capability`: a probe load, cached per environment), and its loaders driven at
tensor-parallel and expert-parallel sizes with stand-in kernels (`tensor_parallel`). What a Linear
applies after loading is judged for every engine alike (harness.differential.effective_weights).
Importing this package imports no vLLM: its modules import it where they run it."""
