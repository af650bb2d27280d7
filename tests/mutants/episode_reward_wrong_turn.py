"""Bug: the reward reads the first assistant turn (the tool call), not the last one (the
final answer)."""


def answer_text(episode):
    assistant = [t for t in episode.turns if t.role == "assistant"]
    return assistant[0].text if assistant else ""  # should be assistant[-1]
