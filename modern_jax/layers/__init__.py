"""The building blocks of the model, one module per choice of SPEC section 1."""
