"""An OpenAI-compatible server over the session store (`eval.serve.cli`)."""
