// gumiho-chat's page script: four small jobs the server cannot do from Python.
() => {
  // 1. Keep the newest tokens in view while an answer streams.
  const follow = () => {
    const log = document.getElementById("chat-log");
    if (log) log.scrollTop = log.scrollHeight;
  };

  // 2. The open session in the address (/?session=ID), so a reload or a bookmark comes back
  //    to it. The server writes the id on the chat log (data-session; "" = not stored yet); the
  //    page as first built has no such attribute and leaves the address to the load handler.
  const address = () => {
    const log = document.getElementById("chat-log");
    if (!log || !("session" in log.dataset)) return;
    const url = new URL(window.location.href);
    const id = log.dataset.session;
    if ((url.searchParams.get("session") || "") === id) return;
    if (id) url.searchParams.set("session", id);
    else url.searchParams.delete("session");
    window.history.replaceState(null, "", url);
  };

  // 4. In a narrow window (a phone) the sessions sidebar would cover the chat: start with it
  //    closed there; its toggle (the chevron at the top) opens it.
  let sidebarChecked = false;
  const narrowSidebar = () => {
    const toggle = document.querySelector("#sidebar.open .toggle-button");
    if (sidebarChecked || !document.getElementById("sidebar")) return;
    sidebarChecked = true;
    if (toggle && window.innerWidth < 700) toggle.click();
  };

  new MutationObserver(() => { follow(); address(); narrowSidebar(); })
    .observe(document.body, { childList: true, subtree: true, attributes: true, attributeFilter: ["data-session"] });

  // 3. A number typed into a slider's box stays within the slider's range (its min and max),
  //    as dragging the slider does: 5 typed for a temperature that stops at 2 becomes 2.
  const clamp = (event) => {
    const box = event.target;
    if (!(box instanceof HTMLInputElement) || box.type !== "number") return;
    const value = parseFloat(box.value);
    const low = box.min === "" ? -Infinity : parseFloat(box.min);
    const high = box.max === "" ? Infinity : parseFloat(box.max);
    if (isNaN(value)) return;
    const kept = Math.min(high, Math.max(low, value));
    if (kept !== value) {
      box.value = String(kept);
      box.dispatchEvent(new Event("input", { bubbles: true }));
    }
  };
  document.addEventListener("keydown", (e) => { if (e.key === "Enter") clamp(e); }, true);
  document.addEventListener("change", clamp, true);
  document.addEventListener("blur", clamp, true);
  narrowSidebar();
}
