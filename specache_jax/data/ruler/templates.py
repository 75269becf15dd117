"""RULER's prompt text: task templates, answer prefixes, needle and document formats, the noise haystack.

The wording is RULER's (NVIDIA/RULER, `scripts/data/synthetic/constants.py`; Hsieh et al. 2024, Table 2);
the strings are facts of the benchmark, retyped here. A prompt is the task template (the user turn) followed,
after the model's chat header, by the answer prefix, which the model continues.
"""
from __future__ import annotations

# The noise haystack: this paragraph repeated, one copy per line (niah_single_1, vt).
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

NEEDLE = "One of the special magic {type_v} for {key} is: {value}."

# type_v is the plural ("numbers", "uuids"); with one key and one value asked, RULER switches the question to
# the singular ("A special magic number is hidden ...", "What is the special magic number ...").
NIAH = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. I will quiz "
        "you about the {type_v} afterwards.\n{context}\nWhat are all the special magic {type_v} for {query} "
        "mentioned in the provided text?")
NIAH_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
NIAH_SINGULAR = ("A special magic {type_v} is hidden within the following text. Make sure to memorize it. I will "
                 "quiz you about the {type_v} afterwards.\n{context}\nWhat is the special magic {type_v} for "
                 "{query} mentioned in the provided text?")
NIAH_SINGULAR_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text is"

VT = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
      "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assigned the value {query}, they are: ")

CWE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
       "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"

FWE = ("Read the following coded text and track the frequency of each coded word. Find the three most frequently "
       "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
       "What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

QA = ("Answer the question based on the given documents. Only give me the answer and do not output any other "
      "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
      "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}")
QA_PREFIX = " Answer:"
DOCUMENT = "Document {i}:\n{document}"
