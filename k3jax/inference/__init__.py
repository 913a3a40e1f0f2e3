"""Running a trained model: the library under ``eval``, ``eval.generate``, ``eval.chat``,
``eval.serve``, RL's rollouts and the benchmarks.

    layout     the inference mesh and where weights and session pools lie on it
               (`inference_placement`, `Placement`, `INFERENCE_RULES`)
    load       a model back from its checkpoints onto one device or a mesh, in its stored
               precision or cast (`load_run`, `restore_model`), a draft model checked against its
               target and placed beside it (`load_draft`, `draft_mismatch`, `draft_mesh`),
               `InputError` for every bad input on the way
    adapters   several LoRA fine-tunes served over one base, each request choosing one, decoded in
               one batch (`ServedAdapters`: adapter banks, loading and unloading by name)
    generation batched generation in one compiled loop (`generate`), or by speculative rounds
               over a session store
    chat       prompts and replies in K3's chat format, turn by turn (`chat_turns_for`, `ChatTurns`)

The pieces it runs on have their own homes: the memory bank (`k3jax.memory`), the session store
(`k3jax.sessions`), the sampling rules (`k3jax.sampling`), speculative decoding's settings
(`k3jax.config.SpeculationConfig`) and rules (`k3jax.speculative`).
"""
from .generation import Generation, generate
from .layout import INFERENCE_RULES, MeshError, Placement, inference_placement
from .load import (InputError, LoadedRun, RestoredModel, draft_mesh, draft_mismatch, load_draft, load_run, place_model,
                   restore_model)

__all__ = ["INFERENCE_RULES", "MeshError", "Placement", "inference_placement", "Generation", "InputError", "LoadedRun",
           "RestoredModel", "draft_mesh", "draft_mismatch", "generate", "load_draft", "load_run", "place_model",
           "restore_model"]
