"""Models the policy server can serve, with their tokenizers and chat templates."""

from sciproto.models.loading import LoadedModel, load_model, model_directory

__all__ = ["LoadedModel", "load_model", "model_directory"]
