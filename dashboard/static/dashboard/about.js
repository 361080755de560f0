/* The about page (dashboard/templates/dashboard/about.html): "copy summary" puts the page's
   lists on the clipboard as plain text ("## Section" then "name: value" lines), for a bug
   report. The page itself needs no script. */
(function () {
  "use strict";
  function summary() {
    var out = [];
    document.querySelectorAll(".about section").forEach(function (section) {
      out.push("## " + section.querySelector("h2").textContent.trim());
      section.querySelectorAll("dl > div").forEach(function (row) {
        var value = row.querySelector("dd").textContent.replace(/\s+/g, " ").trim();
        out.push(row.querySelector("dt").textContent.trim() + ": " + value);
      });
      out.push("");
    });
    return out.join("\n");
  }
  document.addEventListener("DOMContentLoaded", function () {
    var button = document.querySelector("[data-testid=copy-summary]");
    var result = document.querySelector("[data-testid=copy-result]");
    button.addEventListener("click", function () {
      var text = summary();
      if (!navigator.clipboard) {  // not a secure context (plain http to another host)
        window.prompt("Copy the summary:", text);
        return;
      }
      navigator.clipboard.writeText(text).then(function () {
        result.textContent = "copied";
      }, function (err) {
        result.textContent = "the browser refused the clipboard (" + err + ")";
      });
    });
  });
})();
