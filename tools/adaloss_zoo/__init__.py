"""Third-party models in tiny configurations, random init, no network: the model zoo.

``adaloss_zoo.torch_zoo`` holds HF transformers (GPT2, Llama, BERT), torchvision
resnet18 and a timm ViT; ``adaloss_zoo.jax_zoo`` Flax linen (``TrainState``,
batch closed over), Flax nnx (BatchNorm, Dropout, ``nnx.Optimizer``) and
Equinox models, each written the way its library's documentation writes it.
``adaloss_zoo.metrics`` compares gradients (framework-neutral, NumPy).
Importing this package imports neither framework.
"""
