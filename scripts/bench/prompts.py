"""The prompts every benchmark and load test draws from: Python openings the bundled model was trained on."""

# 16 short openings: one per lane of a 16-lane batch (tinyloop bench batch, the batching load tests)
CODE_PROMPTS = ["def fibonacci(n):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
                "for i in range(10):\n    ", "def read_file(path):\n    with open(path) as f:\n", "if __name__ == '__main__':\n",
                "    return sorted(items, key=", "try:\n    import json\nexcept ImportError:\n", "def __repr__(self):\n        return",
                "x = [i * i for i in", "while True:\n    line = f.readline()\n", "@property\ndef name(self):\n",
                "raise ValueError(", "def test_add():\n    assert", "with open(path, 'w') as out:\n", "self.items.append("]

# longer openings, for speculative decoding: drafts have context to agree with
LONG_CODE_PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n    parser = ",
                     "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
                     "def read_config(path):\n    with open(path) as f:\n        ",
                     "    for i, line in enumerate(lines):\n        if not line.strip():\n"]
