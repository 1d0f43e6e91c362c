"""Everything about judging SGLang, in one folder: the engine (`engine`: SGLang's own model loader,
layers and `process_weights_after_loading`, run on CPU in SGLang's interpreter), the few kernel
choices that need a CUDA driver, stood in (`stand_ins`), what its processing leaves decoded back to
the weight a Linear applies (`applied`), and where SGLang's interpreter is (`environment`).
Importing this package imports no SGLang: its modules import it where they run it."""
