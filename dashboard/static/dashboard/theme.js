/* Light or dark: the system's choice (prefers-color-scheme) unless the operator chose one on
   this browser (localStorage "gpuproxy-theme": "light" or "dark"; none stored = system, as
   llama-swap's light/dark/system). Runs in <head>, before the first paint, and wires the
   header's switch once the page is parsed. No dependency.

   The switch cycles system -> the theme the system is not -> the one it is -> system, so
   that the first click always changes what is seen (a plain system -> light -> dark would do
   nothing visible on a light system); choosing system removes the stored choice. */
(function () {
  "use strict";
  var KEY = "gpuproxy-theme";
  var root = document.documentElement;
  function stored() {
    var value = null;
    try { value = localStorage.getItem(KEY); } catch (e) { /* private mode */ }
    return value === "light" || value === "dark" ? value : null;
  }
  function store(value) {
    try {
      if (value) localStorage.setItem(KEY, value); else localStorage.removeItem(KEY);
    } catch (e) { /* private mode: this page only */ }
  }
  function system() {
    return window.matchMedia && window.matchMedia("(prefers-color-scheme: dark)").matches
      ? "dark" : "light";
  }
  var chosen = stored();  // "light", "dark" or null for the system's
  function apply() {
    root.dataset.theme = chosen || system();
    root.dataset.themeMode = chosen || "system";
  }
  apply();
  if (window.matchMedia) {
    var query = window.matchMedia("(prefers-color-scheme: dark)");
    if (query.addEventListener) query.addEventListener("change", apply);
  }
  function other(theme) { return theme === "dark" ? "light" : "dark"; }
  document.addEventListener("DOMContentLoaded", function () {
    var button = document.querySelector(".theme-switch");
    if (!button) return;
    function label() {
      var mode = chosen || "system";
      button.textContent = "theme: " + mode;
      var next = chosen === null ? other(system()) : (chosen === system() ? "system" : system());
      button.title = "light, dark or the system's (" + system() + "); click for " + next;
    }
    label();
    if (window.matchMedia && query.addEventListener) query.addEventListener("change", label);
    button.addEventListener("click", function () {
      if (chosen === null) chosen = other(system());
      else if (chosen === system()) chosen = null;
      else chosen = system();
      store(chosen);
      apply();
      label();
    });
  });
})();
