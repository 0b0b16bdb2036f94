"""The configuration's types, and the one reader of the environment that fills them."""
