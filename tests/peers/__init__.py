"""Out-of-process peer implementations (GPTQModel, AutoAWQ) used as test judges.

Workers run in a subprocess because importing ``gptqmodel`` patches transformers
globally and ``import awq`` rewrites the global warning filters.
"""
