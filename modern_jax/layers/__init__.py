"""The building blocks of the model, one module per choice of the README's Configuration table."""
