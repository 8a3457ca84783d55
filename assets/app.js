// gumiho-chat: keep the newest tokens in view while an answer streams.
() => {
  const follow = () => {
    const log = document.getElementById("chat-log");
    if (log) log.scrollTop = log.scrollHeight;
  };
  new MutationObserver(follow).observe(document.body, { childList: true, subtree: true });
}
